"""Slot storage: one layer's buffers and the row operations on them.

Per (sequence, KV head) a layer holds ``capacity`` slots: key and value vectors, the policy's
score (float32), the token's ordinal among the real tokens of its sequence, and whether the slot
is live. Per sequence (row) it holds the count of real tokens seen and the row's budget
(``heavy``, ``recent``, protected ``sinks``); with head-adaptive budgets (``head_budget.py``) also
``head_heavy`` ``[B, H]``, each head's own heavy part (None: every head has the row's ``heavy``). Attention does not depend on slot order, so slots
can be reordered, cut or padded freely without changing any result.

**Ragged slots.** When the budgets of a layer's (row, head)s differ, the dense layout holds the
widest one for every head. Once every head is at its budget with its live slots packed in front
(``decode.at_budget``), the native decode stepper ``flatten``s the layer: each (row, head) keeps
only its own ``budget + 1`` slots, in flat ``[T(, D)]`` tensors (``RaggedSlots``), and the dense
ones are freed (the layer's slot tensors are None). Every other path calls ``to_dense`` first,
which brings the dense layout back; the native step keeps the layer flat. A kvzip layer filling
its tail is flat too (``decode.TailFill``): each head its live slots and a little room, grown by
``regrow`` as the tail fills, so the bytes held follow the live tokens, not the widest head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2okv.core.quant import SCALE_DTYPE

# per-slot tensors [B, H, capacity(, D)] and per-row tensors [B(, ...)] (``key_center``: [B, H, D])
SLOT_TENSORS = ("keys", "values", "score", "ordinal", "valid")
ROW_VECTORS = ("n_real", "heavy", "recent", "sinks", "head_heavy", "key_center")
# quantized slots (``core/quant.py``): ``keys`` and ``values`` hold the codes, and these each
# group's float16 scale and low, [B, H, capacity, G]: slot tensors like the others
CODEC_TENSORS = ("key_scale", "key_low", "value_scale", "value_low")
# a float window of quantized slots (``core/quant.py``): each row's last W tokens in the model's
# dtype, at place ``ordinal % W`` (``[B, H, W, D]``), and the ordinal each place holds (``[B, W]``,
# -1: none yet); per row, so the row operations move them as they move ``n_real``
WINDOW_TENSORS = ("window_keys", "window_values", "window_ordinal")


def first_free(valid: torch.Tensor) -> torch.Tensor:
    """``[B, H, 1]``: each (row, head)'s first free slot (``valid`` ``[B, H, capacity]``)."""
    return valid.view(torch.uint8).argmin(dim=-1, keepdim=True)


@dataclass
class RaggedSlots:
    """A layer's slots, each (row, head) ``r`` holding its first ``widths[r]`` only: flat tensors
    ``[T(, D)]`` in (row, head, slot) order; ``base[r]`` is where ``r``'s slots start. ``shape``:
    the dense layout's ``(B, H, capacity)``."""

    keys: torch.Tensor
    values: torch.Tensor
    score: torch.Tensor
    ordinal: torch.Tensor
    valid: torch.Tensor
    base: torch.Tensor
    widths: torch.Tensor
    shape: tuple[int, int, int]

    def kept(self) -> torch.Tensor:
        """``[B, H, capacity]``: which dense slots the flat tensors hold."""
        b, h, cap = self.shape
        return torch.arange(cap, device=self.widths.device) < self.widths.view(b, h, 1)


class SlotStorage:
    """The buffers of one layer; ``SlotLayer`` adds the step on top."""

    is_initialized: bool
    peak_capacity: int
    ragged: RaggedSlots | None = None  # see the module docstring
    coding = None  # a SlotCoding when the slots are quantized (``core/quant.py``), else None
    _codes_for = None  # the last call's keys and values with their codes (``remember_codes``)
    window_keys = window_values = window_ordinal = None  # a float window (WINDOW_TENSORS), else None
    # centered keys (``quant.KeyCenter``): each row's turned-back mean key per head ``[B, H, D]``
    # (float16), else None; ``center_pending``: a row may still be waiting for its first tokens
    key_center = None
    center_pending = False
    center_freq = None  # the model's rotary frequencies on the layer's device, for centered keys
    slot_tensors = SLOT_TENSORS  # the per-slot tensors every row and capacity operation moves
    stepper = None  # SlotLayer's decode stepper
    #: moves on every change of the rows or buffers that something is derived from (``changed``)
    version: int = 0

    def flatten(self, widths: torch.Tensor) -> None:
        """Keep each (row, head)'s first ``widths`` slots only (``[B * H]``; its live slots must be
        among them): the dense slot tensors are dropped (None until ``to_dense``)."""
        b, h, cap = self.valid.shape
        if self.coding is not None:  # the flat steps (native, kvzip's tail) read float slots
            raise RuntimeError("quantized slots are kept dense")
        if int(widths.max()) > cap:  # a width past the buffer would shift every later head's offset
            raise RuntimeError(f"cannot flatten: a head's width {int(widths.max())} exceeds the capacity {cap}")
        base = torch.cumsum(widths, 0) - widths
        ragged = RaggedSlots(**dict.fromkeys(SLOT_TENSORS), base=base.contiguous(), widths=widths, shape=(b, h, cap))
        kept = ragged.kept()
        for name in SLOT_TENSORS:
            setattr(ragged, name, getattr(self, name)[kept].contiguous())
            setattr(self, name, None)
        self.ragged = ragged

    def regrow(self, widths: torch.Tensor) -> None:
        """Re-cut a flat layer to ``widths`` ``[B * H]``, each at least the (row, head)'s present
        width: its slots keep their place at the front, the new ones are free (kvzip's tail grows
        each head's own slots as it fills, ``decode.TailFill``)."""
        old = self.ragged
        b, h, cap = old.shape
        total = int(widths.sum())
        base = torch.cumsum(widths, 0) - widths
        owner = torch.repeat_interleave(torch.arange(len(widths), device=widths.device), widths, output_size=total)
        offset = torch.arange(total, device=widths.device) - base[owner]
        keep = offset < old.widths[owner]
        source = (old.base[owner] + offset)[keep]
        ragged = RaggedSlots(**dict.fromkeys(SLOT_TENSORS), base=base.contiguous(), widths=widths,
                             shape=(b, h, max(cap, int(widths.max()))))
        for name in SLOT_TENSORS:
            flat = getattr(old, name)
            grown = flat.new_zeros((total, *flat.shape[1:]))  # zeros: valid=False, free
            grown[keep] = flat[source]
            setattr(ragged, name, grown)
        self.ragged = ragged

    def to_dense(self) -> None:
        """The dense slot tensors back from the flat ones (free slots past each width); nothing to
        do for a dense layer. Every path but the native decode step reads the dense layout, so each
        calls this first."""
        if self.ragged is None:
            return
        self.stepper = None  # it ran the flat layout; the next call's end chooses again
        dense = {name: self.read(name) for name in SLOT_TENSORS}
        self.ragged = None
        for name, tensor in dense.items():
            setattr(self, name, tensor)

    def read(self, name: str) -> torch.Tensor:
        """Slot tensor ``name`` in the dense layout ``[B, H, capacity(, D)]``, for readers (stats,
        evaluations): a flat layer's is a copy, and the layer stays as it is."""
        ragged = self.ragged
        if ragged is None:
            return getattr(self, name)
        flat = getattr(ragged, name)
        dense = flat.new_zeros((*ragged.shape, *flat.shape[1:]))  # zeros: valid=False, free
        dense[ragged.kept()] = flat
        return dense

    def init_buffers(self, key_states: torch.Tensor, value_states: torch.Tensor, coding=None) -> None:
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.head_dims = (d, dv)
        self.coding = coding
        self.window_keys = self.window_values = self.window_ordinal = None
        self.key_center, self.center_pending = None, False
        if coding is None:
            self.slot_tensors = SLOT_TENSORS
            self.keys = key_states.new_zeros((b, h, 0, d))
            self.values = value_states.new_zeros((b, h, 0, dv))
        else:
            self.slot_tensors = SLOT_TENSORS + CODEC_TENSORS
            codes = {"dtype": torch.uint8, "device": self.device}
            self.keys = torch.zeros((b, h, 0, coding.keys.code_width(d)), **codes)
            self.values = torch.zeros((b, h, 0, coding.values.code_width(dv)), **codes)
            scales = {"dtype": SCALE_DTYPE, "device": self.device}
            self.key_scale = torch.zeros((b, h, 0, coding.keys.groups(d)), **scales)
            self.key_low = torch.zeros((b, h, 0, coding.keys.groups(d)), **scales)
            self.value_scale = torch.zeros((b, h, 0, coding.values.groups(dv)), **scales)
            self.value_low = torch.zeros((b, h, 0, coding.values.groups(dv)), **scales)
            if coding.center is not None:
                self.key_center = torch.zeros((b, h, d), dtype=SCALE_DTYPE, device=self.device)
                self.center_freq = coding.center.frequencies(self.device)
                self.center_pending = True
            if coding.window:
                self.window_keys = key_states.new_zeros((b, h, coding.window, d))
                self.window_values = value_states.new_zeros((b, h, coding.window, dv))
                self.window_ordinal = torch.full((b, coding.window), -1, dtype=torch.long, device=self.device)
        self.score = torch.zeros((b, h, 0), dtype=torch.float32, device=self.device)
        self.ordinal = torch.zeros((b, h, 0), dtype=torch.long, device=self.device)
        self.valid = torch.zeros((b, h, 0), dtype=torch.bool, device=self.device)
        self.n_real = torch.zeros((b,), dtype=torch.long, device=self.device)
        # heavy/recent/sinks are set by the first forward call (the prompt fixes the budget)
        self.heavy = self.recent = self.sinks = None
        self.head_heavy = None

    @property
    def centering(self) -> tuple | None:
        """``(key_center, center_freq)`` for ``SlotCoding``'s key methods, or None: keys not centered."""
        return None if self.key_center is None else (self.key_center, self.center_freq)

    # -- the keys and values as attention reads them --------------------------------------------
    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[B, H, capacity, D]`` in the model's dtype: the slot tensors
        themselves, or for quantized slots their dequantized copies (``core/quant.py``)."""
        if self.coding is None:
            return self.keys, self.values
        return self.with_window(*self.coded_kv())

    def with_window(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded ``keys``/``values`` (``coded_kv``) with the slots the float window holds read from
        it, as new tensors (the decoded ones stay as they are); the same ones without a window."""
        if self.window_ordinal is None:
            return keys, values
        place, recent = self._window_places()
        return self._from_window(self.window_keys, keys, place, recent), \
            self._from_window(self.window_values, values, place, recent)

    def coded_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantized layer's keys and values decoded from their codes, float window or not."""
        return (self.float_keys(window=False),
                self.coding.values.decode(self.values, self.value_scale, self.value_low, self.dtype))

    def banded_kv(self, slot_of_token, k_new, v_new, ordinals, allowed):
        """What a call's queries attend over when the layer keeps a float window: query ``i`` reads
        its own last ``W`` tokens (ordinals above ``i - W``) in float and older ones from their codes,
        as a one-token step does, however the tokens were cut into calls. Each slot twice, coded then
        float (``[B, H, 2 x capacity, D]``), and ``allowed`` ``[B, H, m, capacity]`` split between
        the two by that band; a slot's mass is the sum of its two halves. The call's tokens are
        written (codes in ``slot_of_token``), the window not yet: it still holds the tokens before
        the call, the floats of the band's older half."""
        coded_keys, coded_values = self.coded_kv()
        float_keys, float_values = self.with_window(coded_keys, coded_values)
        for floats, new in ((float_keys, k_new), (float_values, v_new)):
            floats.scatter_(2, slot_of_token[..., None].expand(*slot_of_token.shape, new.shape[-1]), new)
        band = self.ordinal[:, :, None, :] > (ordinals - self.window_ordinal.shape[1])[:, None, :, None]
        return (torch.cat([coded_keys, float_keys], 2), torch.cat([coded_values, float_values], 2),
                torch.cat([allowed & ~band, allowed & band], -1))

    def float_keys(self, window: bool = True) -> torch.Tensor:
        """The keys in the model's dtype, as ``kv()`` gives them (``window=False``: as their codes
        give them, a float window or not)."""
        if self.coding is None:
            return self.keys
        keys = self.coding.decode_keys((self.keys, self.key_scale, self.key_low), self.centering, self.ordinal,
                                       self.dtype)
        if not window or self.window_ordinal is None:
            return keys
        return self._from_window(self.window_keys, keys, *self._window_places())

    def _window_places(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(place, recent)`` ``[B, H, capacity]``: each slot's place in the float window, and
        whether that place holds its token (a free slot's stale ordinal may match too: nothing
        reads a free slot)."""
        b, h, cap = self.ordinal.shape
        place = self.ordinal.remainder(self.window_ordinal.shape[1])
        held = self.window_ordinal.gather(1, place.reshape(b, h * cap)).view(b, h, cap)
        return place, held == self.ordinal

    @staticmethod
    def _from_window(window, decoded, place, recent) -> torch.Tensor:
        floats = window.gather(2, place[..., None].expand(*place.shape, window.shape[-1]))
        return torch.where(recent[..., None], floats, decoded)

    def remember_recent(self, ordinal: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                        real: torch.Tensor | None = None) -> None:
        """Keep the float window (``WINDOW_TENSORS``) of tokens just written: ``ordinal`` ``[B, m]``
        their ordinals (consecutive, a row's real tokens first), their keys and values
        ``[B, H, m, D]``, ``real`` ``[B, m]`` (None: all real). Only the tokens that are among
        their row's last ``W`` are written, so no two land on one place."""
        if self.window_ordinal is None:
            return
        width = self.window_ordinal.shape[1]
        if ordinal.shape[1] == 1 and real is None:  # a decode step: one token a row, in tensor ops
            place = ordinal.remainder(width)
            self.window_ordinal.scatter_(1, place, ordinal)
            for window, new in ((self.window_keys, k_new), (self.window_values, v_new)):
                window.scatter_(2, place[:, None, :, None].expand(-1, window.shape[1], 1, window.shape[-1]), new)
            return
        if real is None:
            real = torch.ones(ordinal.shape, dtype=torch.bool, device=ordinal.device)
        end = ordinal[:, :1] + real.sum(-1, keepdim=True)  # each row's tokens after the call
        rows, tokens = (real & (ordinal >= end - width)).nonzero(as_tuple=True)
        ordinals = ordinal[rows, tokens]
        place = ordinals.remainder(width)
        self.window_ordinal[rows, place] = ordinals
        self.window_keys[rows, :, place] = k_new[rows, :, tokens]
        self.window_values[rows, :, place] = v_new[rows, :, tokens]

    def remember_codes(self, k_new: torch.Tensor, v_new: torch.Tensor, key_parts: tuple, value_parts: tuple) -> None:
        """Keep the codes ``(codes, scale, low)`` that the call's keys and values ``k_new``/``v_new``
        were decoded from, for the write that follows: a decode step would otherwise code them a
        second time (coding a decoded vector gives the same codes, ``quant.py``), some 20 tensor ops
        a layer and a step, which on a GPU cost in launches what the arithmetic does not."""
        self._codes_for = (k_new, v_new, key_parts, value_parts)

    def codes_of(self, k_new: torch.Tensor, v_new: torch.Tensor, slot: torch.Tensor) -> tuple[tuple, tuple]:
        """``(key parts, value parts)`` of ``k_new``/``v_new``, bound for ``slot`` ``[B, H, m]``
        (whose ordinals are written: centered keys are coded by them): the remembered ones when
        these are the very tensors they were decoded into (a slice of them, a chunk's, is coded again)."""
        kept, self._codes_for = self._codes_for, None
        if kept is not None and kept[0] is k_new and kept[1] is v_new:
            return kept[2], kept[3]
        ordinal = self.ordinal.gather(2, slot) if self.key_center is not None else None
        return self.coding.encode_keys(k_new, self.centering, ordinal), self.coding.values.encode(v_new)

    def write_token_and_read(self, slot: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor):
        """A quantized layer's decode step in a kernel (C or Triton, dense): the new token's codes,
        ordinal and float-window place written into ``slot`` ``[B, H, 1]`` as the tensor-op step
        writes them (``decode.write_and_attend``), then ``kv()``: the float copy of every slot that
        the kernel attends over and ranks. The kernel writes the token's float key and value into
        that copy too (the same values: the call passed them as they are stored,
        ``SlotLayer._as_stored``), and the copy is dropped after the step."""
        self.write_token(slot, k_new, v_new)
        return self.kv()

    def write_token(self, slot: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """A decode step's token (ordinal ``n_real``) into ``slot`` ``[B, H, 1]``: its key and value
        (``write_kv``), its ordinal and its float-window place; its score and liveness are the step's."""
        b = self.n_real.shape[0]
        # first: kv() finds the window place by it, and centered keys are coded by it
        self.ordinal.scatter_(2, slot, self.n_real.view(b, 1, 1).expand_as(slot))
        self.write_kv(slot, k_new, v_new)
        self.remember_recent(self.n_real.view(b, 1), k_new, v_new)

    def write_kv(self, slot: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write token ``j``'s key and value ``[B, H, m, D]`` into slot ``slot[..., j]`` ``[B, H, m]``
        (coded, for quantized slots, whose ordinals are written first; a float window is kept by
        ``remember_recent``)."""
        if self.coding is None:
            parts = (("keys", k_new), ("values", v_new))
        else:
            (k_codes, k_scale, k_low), (v_codes, v_scale, v_low) = self.codes_of(k_new, v_new, slot)
            parts = (("keys", k_codes), ("key_scale", k_scale), ("key_low", k_low),
                     ("values", v_codes), ("value_scale", v_scale), ("value_low", v_low))
        for name, part in parts:
            getattr(self, name).scatter_(2, slot[..., None].expand(*slot.shape, part.shape[-1]), part)

    def bytes_per_slot(self, float_itemsize: int | None = None) -> int:
        """What one slot's key and value take (a quantized slot's scales and lows included);
        ``float_itemsize``: an unquantized slot's element size to count instead of the model
        dtype's (2: what the slot would take in a 16-bit cache)."""
        d, dv = self.head_dims
        if self.coding is None:
            return (d + dv) * (float_itemsize or self.dtype.itemsize)
        return self.coding.bytes_per_slot(d, dv)

    def store_kv(self, keys: torch.Tensor, values: torch.Tensor, ordinal: torch.Tensor) -> None:
        """Replace every slot's key and value by ``keys`` / ``values`` ``[B, H, capacity, D]``, the
        tokens of ``ordinal`` ``[B, H, capacity]`` (centered keys are coded by it)."""
        if self.coding is None:
            self.keys, self.values = keys, values
            return
        self.keys, self.key_scale, self.key_low = self.coding.encode_keys(keys, self.centering, ordinal)
        self.values, self.value_scale, self.value_low = self.coding.values.encode(values)

    @property
    def capacity(self) -> int:
        return self.ragged.shape[2] if self.ragged is not None else self.keys.shape[2]

    @property
    def has_budget(self) -> bool:
        return self.is_initialized and self.heavy is not None

    def heads_heavy(self) -> torch.Tensor:
        """``[B, H]``: each head's heavy part (the row's own when budgets are uniform)."""
        if self.head_heavy is not None:
            return self.head_heavy
        return self.heavy[:, None].expand(-1, self.keys.shape[1]).clone()

    def slot_budget(self) -> torch.Tensor:
        """Slots each (row, head) may hold: ``[B, 1]``, or ``[B, H]`` with head-adaptive budgets."""
        if self.head_heavy is not None:
            return self.head_heavy + self.recent[:, None]
        return (self.heavy + self.recent)[:, None]

    def live_slots(self) -> torch.Tensor:
        """``[B, H]`` live tokens per (sequence, head) (a flattened layer stays flat)."""
        if not self.is_initialized:
            return torch.zeros(0, dtype=torch.long)
        ragged = self.ragged
        if ragged is None:
            return self.valid.sum(-1)
        owner = torch.repeat_interleave(torch.arange(len(ragged.widths), device=ragged.widths.device), ragged.widths)
        counts = torch.zeros(len(ragged.widths), dtype=torch.long, device=owner.device)
        return counts.index_add_(0, owner, ragged.valid.long()).view(ragged.shape[:2])

    # -- capacity ------------------------------------------------------------------------------
    def resize(self, capacity: int) -> None:
        """Give every (sequence, head) exactly ``capacity`` slots.

        Growing pads with free slots. Shrinking cuts the tail when no live slot lies there (the
        usual case: nothing moves, so a row keeps exactly the layout it has alone, and with it
        the eviction tie-breaks: bit-identical generations whether it runs alone or in a batch);
        otherwise live slots move to the front first, in slot order.
        """
        self.to_dense()
        current = self.capacity
        if capacity == current:
            return
        if capacity > current:
            for name in self.slot_tensors:
                old = getattr(self, name)
                shape = list(old.shape)
                shape[2] = capacity
                new = old.new_zeros(shape)  # zeros: valid=False, i.e. free slots
                new[:, :, :current] = old
                setattr(self, name, new)
            self.peak_capacity = max(self.peak_capacity, capacity)
            return
        if not bool(self.valid[..., capacity:].any()):
            for name in self.slot_tensors:
                setattr(self, name, getattr(self, name)[:, :, :capacity].clone())  # clone: free the rest
            return
        live = int(self.valid.sum(-1).max())
        if live > capacity:
            raise RuntimeError(f"cannot fit {live} live slots into {capacity}")
        self.pack_live(capacity)

    def pack_live(self, capacity: int | None = None) -> None:
        """Move each (sequence, head)'s live slots to the front, in slot order (slot order changes
        no result). Without ``capacity`` in place, so views of the slot tensors stay valid (the
        decode step's fast state holds some); with it, keep the first ``capacity`` slots only."""
        order = torch.argsort((~self.valid).view(torch.uint8), dim=-1, stable=True)
        if capacity is not None:
            order = order[..., :capacity]
        for name in self.slot_tensors:
            tensor = getattr(self, name)
            index = order if tensor.dim() == 3 else order[..., None].expand(*order.shape, tensor.shape[-1])
            moved = tensor.gather(2, index)
            if capacity is None:
                tensor.copy_(moved)
            else:
                setattr(self, name, moved)

    # -- rows ------------------------------------------------------------------------------------
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (in that order, repeats allowed): beam search, batch changes."""
        if not self.is_initialized:
            return
        self.to_dense()
        index = index.to(self.device)
        for name in self.slot_tensors + ROW_VECTORS + WINDOW_TENSORS:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, tensor.index_select(0, index))
        self.changed()

    def append_rows(self, other: SlotStorage) -> None:
        """Append ``other``'s rows after ours; both are brought to the larger capacity first."""
        self.to_dense()
        other.to_dense()
        capacity = max(self.capacity, other.capacity)
        self.resize(capacity)
        other.resize(capacity)
        if (self.head_heavy is None) != (other.head_heavy is None):
            for part in (self, other):  # a uniform row is a row whose heads all have its heavy part
                part.head_heavy = part.heads_heavy()
        if self.coding != other.coding:
            raise RuntimeError(f"cannot join caches of other slot codings ({self.coding} and {other.coding})")
        for name in self.slot_tensors + ROW_VECTORS + WINDOW_TENSORS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if (mine is None) != (theirs is None):
                raise RuntimeError(f"cannot join a prefilled cache with one that has not run ({name})")
            if mine is not None:
                setattr(self, name, torch.cat([mine, theirs.to(self.device)]))
        self.center_pending = self.center_pending or other.center_pending
        self.changed()

    def add_empty_rows(self, heavy: torch.Tensor, recent: torch.Tensor, sinks: torch.Tensor) -> None:
        """Append ``len(heavy)`` rows with no token yet (every slot free) and these budgets."""
        k = int(heavy.shape[0])
        self.to_dense()
        for name in self.slot_tensors:
            old = getattr(self, name)
            setattr(self, name, torch.cat([old, old.new_zeros((k, *old.shape[1:]))]))  # zeros: free slots
        self.n_real = torch.cat([self.n_real, self.n_real.new_zeros(k)])
        if self.key_center is not None:  # set by the new rows' first tokens (``SlotLayer._as_stored``)
            self.key_center = torch.cat([self.key_center, self.key_center.new_zeros((k, *self.key_center.shape[1:]))])
            self.center_pending = True
        if self.window_ordinal is not None:  # an empty window: every place holds none (-1)
            self.window_keys = torch.cat([self.window_keys, self.window_keys.new_zeros((k, *self.window_keys.shape[1:]))])
            self.window_values = torch.cat([self.window_values,
                                            self.window_values.new_zeros((k, *self.window_values.shape[1:]))])
            self.window_ordinal = torch.cat([self.window_ordinal, self.window_ordinal.new_full((k, self.window_ordinal.shape[1]), -1)])
        if self.heavy is not None:
            self.heavy = torch.cat([self.heavy, heavy.to(self.device)])
            self.recent = torch.cat([self.recent, recent.to(self.device)])
            self.sinks = torch.cat([self.sinks, sinks.to(self.device)])
        if self.head_heavy is not None:  # a new row starts uniform; its first ranked call shares it out
            self.head_heavy = torch.cat([self.head_heavy, heavy.to(self.device)[:, None].expand(k, self.keys.shape[1])])
        self.changed()

    def trim(self) -> None:
        """Cut the free slots after the last live one (of any row and head); nothing moves."""
        self.to_dense()
        live = self.valid.any(dim=1).any(dim=0)  # [capacity]
        used = int(live.nonzero().max()) + 1 if bool(live.any()) else 0
        if used < self.capacity:
            self.resize(used)

    def changed(self) -> None:
        """The rows or buffers changed: ``version`` moves (``SlotLayer`` also derives its decode
        stepper again)."""
        self.version += 1
