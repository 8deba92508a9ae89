"""``SlotLayer``: one decoder layer's slots behind transformers' cache-layer protocol.

``update`` only hands the new key/value states over (``PENDING`` in ``attention.py``); the work of
a forward call happens in ``attend``, called from the registered attention function, because that
is where the query is available. ``attend`` routes a plain decode step to the layer's stepper
(``decode.py``, chosen again by ``changed`` whenever the rows, budgets or buffers change), a
token-by-token call to ``scan.py``, and everything else, chunk by chunk, to ``step.chunk_step``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from h2okv.core.attention import set_pending
from h2okv.core.budget import RowBudgets
from h2okv.core.decode import choose_stepper
from h2okv.core.head_budget import allocate, head_places
from h2okv.core.held import check_call
from h2okv.core.quant import SlotCoding
from h2okv.core.reconstruction import check_probe_call, probe_attention
from h2okv.core.scan import can_scan, token_scan
from h2okv.core.step import chunk_step, evict, policy_key, protected
from h2okv.core.storage import CODEC_TENSORS, SlotStorage
from h2okv.core.words import span_max
from h2okv.errors import H2OError
from h2okv.policies import Policy

# decode growth before the budget is reached: an eighth of the capacity at a time, at least this
# many slots. Small, so a short chat that never reaches its budget holds at most a few slots more
# than a full cache of the same tokens (32 made a 49-token answer hold 73 slots, 149% of full's);
# an eighth keeps the resizes (a copy each) to a handful per doubling.
GROWTH_MIN = 8
# late prefill's query block when the chunk size is 1 (it bounds memory; it changes no result)
LATE_BLOCK = 512


@dataclass
class ProbeState:
    """A layer's part in the reconstruction pass (policy ``kvzip``, ``core/reconstruction.py``),
    kept apart from the slots: the generic layer only asks whether it awaits or is in a pass."""

    awaiting: bool = False  # the prompt is read and held whole until the pass ranks it
    ranked: bool = False  # the pass has ranked it (a later call is read as any other)
    best: torch.Tensor | None = None  # while probing: each slot's best probe score
    span: tuple[int, int, int] | None = None  # the call's (head, first, stop) under kvzip:local=1
    tail_slots: int = 0  # once ranked: the slots kvzip's tail adds above the budget (rank_by_probe)


@dataclass(frozen=True)
class LayerConfig:
    """What every layer of a cache is built with (``H2OCache`` checks it)."""

    policy: Policy
    prefill: str  # "chunked" or "late"
    chunk_size: int
    head_budgets: str  # "uniform", "adaptive" or "layers"
    head_floor: float
    compileable: bool = False  # decode steps at the budget in tensor ops torch.compile can trace
    coding: SlotCoding | None = None  # quantized slots (``kv_bits``, core/quant.py); None: the model's dtype


class SlotLayer(SlotStorage, CacheLayerMixin):
    """One decoder layer's slot buffers (``storage.py``) and its forward step.

    A layer holds no reference to its cache: it is built with its ``config`` and the cache's
    ``rows`` (``RowBudgets``: each row's budget, fixed by its first call), and the reconstruction
    pass hands it its probe scores' home (``start_probe``)."""

    is_sliding = False

    def __init__(self, layer_idx: int, config: LayerConfig, rows: RowBudgets):
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        self.rows = rows
        # positions consumed, pads included: what generate needs for positions. A 0-dim CPU tensor
        # advanced in place: a compiled step reads it as a tensor, where an int would be a guard on
        # its value (a recompilation every step); ``tokens_seen`` is its int
        self.seen = torch.zeros((), dtype=torch.long)
        self.peak_capacity = 0
        self.stepper = None  # how a decode step runs (decode.py), chosen by changed()
        self._budget_cap: int | float | None = None  # max_budget, once the rows' budgets are fixed
        # the most live slots a (sequence, head) may hold, and the ``valid`` it was counted on:
        # see ``_live_bound``
        self._live_max, self._live_of = 0, None
        # kvzip: the prompt is held whole until ``h2okv.reconstruct`` ranks it (``rank_by_probe``)
        self.probe = ProbeState()
        # a streamed prefill's part for the next call (core/streamed.py): "hold" (read a piece
        # whole, evict nothing), "probe" (read the prompt's last tokens on top, rank, evict, keep
        # nothing) or None (any other call)
        self.stream: str | None = None
        # rows may hold more than their budget (``H2OCache.set_budgets`` lowered it): until a call
        # brings them down, room for a call is counted from the live slots, not the budget
        self.over_budget = False

    # -- transformers Cache layer protocol ---------------------------------------------------
    @property
    def is_compileable(self) -> bool:  # transformers asks: may it compile the forward with this cache
        return self.config.compileable

    def lazy_initialization(self, key_states, value_states):
        self.init_buffers(key_states, value_states, self.config.coding)
        self.stepper = None
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.probe.awaiting and self.probe.best is None:  # refused before anything changes
            raise H2OError(f"policy {self.config.policy.spec!r} ranks the prompt by reconstruction: call "
                           f"h2okv.reconstruct(model, cache, prompt_ids, tokenizer) after the prompt's forward call")
        # the attention function picks these up (see attention.py); K/V are written into slots
        # there, chunk by chunk, interleaved with eviction
        set_pending((self, key_states, value_states))
        self.seen.add_(key_states.shape[-2])
        return key_states, value_states

    @property
    def tokens_seen(self) -> int:
        return int(self.seen)

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        self.seen = torch.tensor(value, dtype=torch.long)  # a new tensor: a copy keeps its own

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model builds its mask over the *new* tokens only (causal + padding among them); the
        # old tokens' visibility is the slots' valid flag. kv_offset lines the padding mask up.
        # Traced, the tensor (as transformers' StaticLayer gives its length): no guard on a value
        return query_length, self.seen.clone() if torch.compiler.is_compiling() else self.tokens_seen

    def get_seq_length(self) -> int:
        return self.seen.clone() if torch.compiler.is_compiling() else self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None
        self.tokens_seen = 0
        self.peak_capacity = 0
        self.stepper = None
        self.ragged = None
        self.probe = ProbeState()
        self.stream = None

    def reorder_cache(self, beam_idx):
        self.select_rows(torch.as_tensor(beam_idx))

    def batch_select_indices(self, indices):
        self.select_rows(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int):
        if self.is_initialized:
            self.select_rows(torch.arange(self.n_real.shape[0]).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise H2OError("H2OCache cannot be cropped: evicted tokens are gone (assisted decoding is not supported)")

    def changed(self) -> None:
        """The rows, budgets, buffers or layout changed (``version`` moves): derive again, here and
        nowhere else, what depends on them: the largest budget and the decode stepper (one device
        sync; the stepper may flatten the layer). Every method that makes such a change ends here."""
        super().changed()
        self._budget_cap = None
        self.stepper = choose_stepper(self) if self.has_budget else None

    def set_config(self, config: LayerConfig) -> None:
        """Run under ``config`` from now on (``H2OCache.set_compileable``: the steppers change)."""
        self.config = config
        if self.is_initialized:
            self.changed()

    def set_budgets(self, heavy: torch.Tensor, recent: torch.Tensor, sinks: torch.Tensor) -> None:
        """New per-row budgets ``[B]`` (``H2OCache.set_budgets``); nothing is evicted now: the next
        call of two tokens or more ranks what is held and brings each row down to them."""
        self.to_dense()
        self.heavy, self.recent, self.sinks = (t.to(self.device) for t in (heavy, recent, sinks))
        self.over_budget = True
        self.changed()

    def fit_capacity(self, capacity: int) -> None:
        """Exactly ``capacity`` slots per (sequence, head) (``SlotStorage.resize``), then derive again."""
        self.resize(capacity)
        self.changed()

    def copy_rows(self, index: torch.Tensor, rows: RowBudgets) -> SlotLayer:
        """A new layer holding a copy of rows ``index`` and reading its budgets from ``rows``."""
        twin = copy.copy(self)
        twin.rows = rows
        twin.seen = self.seen.clone()  # advanced in place: the copy counts on its own
        twin.select_rows(index)  # index_select: new tensors, this layer keeps its own
        return twin

    def _set_head_heavy(self, head_heavy: torch.Tensor | None) -> None:
        self.head_heavy = head_heavy
        self._budget_cap = None

    # -- capacity --------------------------------------------------------------------------------
    @property
    def max_budget(self) -> int | float:
        """The most slots a (row, head) of this layer may hold (inf before the first call or for a
        policy that keeps everything). Asked on every step by ``ensure_free``: computed (with a
        device sync) once per change of the budgets."""
        if self._budget_cap is None:
            if not self.config.policy.evicts or not self.has_budget:
                return math.inf
            self._budget_cap = int(self.slot_budget().max())
        return self._budget_cap

    def ensure_free(self, m: int) -> None:
        """Make room for ``m`` new tokens in every (sequence, head)."""
        if self.over_budget and self._count_live() <= self.max_budget:
            self.over_budget = False
        if self.capacity >= self.max_budget + m and not self.over_budget:
            return  # steady state: eviction keeps every (sequence, head) at <= budget
        live = self._live_bound()
        if live + m > self.capacity and self.config.policy.evicts:
            live = self._count_live()  # eviction may have freed slots the bound still counts
        needed = live + m
        if needed > self.capacity:
            if m == 1 and self.config.policy.evicts:
                # decode before the budget is reached: grow in steps so growth is amortised (a
                # policy that never evicts grows exactly, like a plain cache: never more memory)
                needed = min(max(needed, self.capacity + max(GROWTH_MIN, self.capacity // 8)), self.max_budget + m)
            self.resize(needed)
        # the caller writes at most m tokens into each (sequence, head) now
        self._live_max, self._live_of = live + m, self.valid

    def _live_bound(self) -> int:
        """The most live slots any (sequence, head) holds, at most, without counting them (a device
        sync, which on a GPU stalls the launch queue every layer of every step) unless the slot
        buffers were replaced since the last count: the last count plus the writes ``ensure_free``
        made room for since. Exact for a policy that never evicts (its longest row takes every
        write); eviction can only lower the truth. Every change that could add live slots
        without such a write (resize, rows selected or appended, scans, flattening) replaces
        ``valid``; in-place changes only write after ``ensure_free``, or free slots."""
        if self._live_of is not self.valid:
            return self._count_live()
        return self._live_max

    def _count_live(self) -> int:
        self._live_max = int(self.valid.sum(-1).max()) if self.capacity else 0
        return self._live_max

    def shrink_to_budget(self) -> None:
        """After a prefill, give back the chunk's extra slots: decode needs budget + 1."""
        target = self.max_budget + 1
        if self.capacity > target and int(self.valid.sum(-1).max()) < target:
            self.resize(target)

    # -- the forward call ------------------------------------------------------------------------
    def attend(self, query, key_new, value_new, new_mask, scaling, sliding_window=None):
        """Write, attend, accumulate and evict for one forward call; returns ``[B, q, Hq, D]``.

        ``new_mask`` is the model's boolean mask over the new tokens only (``get_mask_sizes``);
        we read padding from it and nothing else: causality among new tokens and the model's
        sliding window are applied from the slots' ordinals.
        """
        if self.rows.awaiting_question:  # a context held for its question (core/held.py)
            check_call(self.rows, query.shape[2])
        if self.coding is not None:  # the call's tokens as their slots will give them back (quant.py)
            key_new, value_new = self._as_stored(key_new, value_new, new_mask)
        if self.probe.best is not None:
            return self._attend_probe(query, key_new, value_new, new_mask, scaling, sliding_window)
        if self.stream == "probe":
            return self._attend_stream_probe(query, key_new, value_new, new_mask, scaling, sliding_window)
        if sliding_window is not None and self.tokens_seen <= sliding_window:
            # no query of the call lies a window past any token yet (ordinals < tokens_seen): the
            # window hides nothing, so the layer may take the steps without one (the decode path)
            sliding_window = None
        if new_mask is not None and query.shape[2] == 1 and torch.compiler.is_compiling():
            # traced (generate hands a compileable cache a [B, 1, 1, 1] mask): no branch on the
            # data; a decode token is real there, checked on the device instead of looked at
            torch._assert_async(new_mask.to(torch.bool).all(), "h2okv: a compiled one-token call got a pad token")
            new_mask = None
        if self.stepper is not None and query.shape[2] == 1 and new_mask is None and sliding_window is None:
            return self.stepper.decode(self, query, key_new, value_new, scaling)
        self.to_dense()  # every path below reads the dense layout
        nonpad = None
        if new_mask is not None:
            # a real token always sees itself; a pad key is seen by no query
            nonpad = new_mask.to(torch.bool)[:, 0].diagonal(dim1=-2, dim2=-1)
            if bool(nonpad.all()):
                nonpad = None
        if not self.has_budget:
            b, _, q_len, _ = query.shape
            full = torch.ones(b, q_len, dtype=torch.bool, device=query.device)
            self.heavy, self.recent, self.sinks = self.rows.for_call(full if nonpad is None else nonpad, self.device)
        order = None
        if nonpad is not None:
            # Move every row's real tokens to the front (a right-padded layout): a row's chunks
            # then start at its own first token, as when the sequence runs alone.
            order = torch.argsort((~nonpad).to(torch.int8), dim=-1, stable=True)
            nonpad = nonpad.gather(1, order)
            query, key_new, value_new = (t.gather(2, order[:, None, :, None].expand_as(t))
                                         for t in (query, key_new, value_new))
        out = self._attend_call(query, key_new, value_new, nonpad, scaling, sliding_window)
        return self._finish_call(out, order)

    def _as_stored(self, key_new, value_new, new_mask):
        """The call's keys and values as a query reads them: as their slots give them back (coded and
        decoded), or as they are with a float window, whose paths read each query's own last W
        tokens in float and older ones from their codes (``SlotStorage.banded_kv``)."""
        ordinal = None
        if self.key_center is not None:  # centered keys: coded by each token's ordinal
            ordinal = self._call_ordinals(new_mask, key_new.shape[2])
            if self.center_pending:
                self._set_key_center(key_new, ordinal)
            ordinal = ordinal.clamp_min(0)[:, None, :].expand(key_new.shape[:3])
        if self.coding.window:
            return key_new, value_new
        key_parts, key_new = self.coding.encode_and_decode_keys(key_new, self.centering, ordinal)
        value_parts, value_new = self.coding.values.encode_and_decode(value_new)
        if key_new.shape[2] == 1:  # a decode step's token, written next; a longer call (a probe
            # that writes nothing, a prefill cut in chunks) would only hold its tensors alive
            self.remember_codes(key_new, value_new, key_parts, value_parts)
        return key_new, value_new

    def _call_ordinals(self, new_mask, n: int) -> torch.Tensor:
        """``[B, n]``: each of the call's tokens' ordinal among its row's real tokens, -1 for a pad
        (the order the slots give them: ``step.chunk_step`` counts a row's real tokens from ``n_real``)."""
        if new_mask is None:
            return self.n_real[:, None] + torch.arange(n, device=self.device)
        real = new_mask.to(torch.bool)[:, 0].diagonal(dim1=-2, dim2=-1)
        return torch.where(real, self.n_real[:, None] + real.long().cumsum(-1) - 1, -1)

    def _set_key_center(self, key_new, ordinal) -> None:
        """The mean a row's keys are centered on (``quant.KeyCenter``), from the first tokens of its
        first call with real tokens; rows already under way keep theirs. Runs only while a row
        may lack it (``center_pending``): after the first calls, never (no sync in a decode step)."""
        fresh = (self.n_real == 0) & (ordinal >= 0).any(-1)  # [B]
        mean = self.coding.center.mean_of(key_new, ordinal, self.center_freq)
        self.key_center = torch.where(fresh[:, None, None], mean, self.key_center)
        self.center_pending = bool(((self.n_real == 0) & ~fresh).any())

    def _attend_call(self, query, key_new, value_new, nonpad, scaling, sliding_window):
        """The call in the layer's prefill mode; ``[B, Hq, q, D]`` in the (real-first) order given."""
        config, q_len = self.config, query.shape[2]
        if q_len > 1 and config.prefill == "late":
            return self._attend_late(query, key_new, value_new, nonpad, scaling, sliding_window)
        if q_len > 1 and self.stream == "hold":  # a streamed piece: the probe that follows ranks it
            self.ensure_free(q_len)
            init = torch.zeros(key_new.shape[:3], dtype=torch.float32, device=self.device)
            return self._read_whole(query, key_new, value_new, nonpad, scaling, sliding_window, init)
        chunk = config.chunk_size if q_len > 1 else 1
        if chunk == 1 and q_len > 1 and can_scan(self, nonpad, sliding_window):
            # per-token eviction over the whole call: the logits at once, the recurrence per token
            return token_scan(self, query, key_new, value_new, scaling)
        init = self._prefill_scores(query, key_new, value_new, nonpad, scaling) if q_len > 1 and chunk > 1 else None
        if q_len > 1 and chunk > 1 and config.head_budgets == "adaptive":
            self._share_out_upfront(key_new, nonpad, init)
        outputs = []
        for start in range(0, q_len, chunk):
            part = slice(start, min(start + chunk, q_len))
            outputs.append(chunk_step(
                self, query[:, :, part], key_new[:, :, part], value_new[:, :, part],
                None if nonpad is None else nonpad[:, part], scaling, sliding_window,
                None if init is None else init[:, :, part],
            ))
        if q_len > 1:
            self.shrink_to_budget()
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)

    def _finish_call(self, out, order):
        """The decode stepper, and ``out`` ``[B, Hq, q, D]`` back in the call's token order as ``[B, q, Hq, D]``."""
        self.changed()
        if order is not None:
            out = torch.empty_like(out).scatter_(2, order[:, None, :, None].expand_as(out), out)
        return out.transpose(1, 2).contiguous()

    def _attend_late(self, query, key_new, value_new, nonpad, scaling, sliding_window):
        """Late prefill: attend exactly over the whole call, then rank and evict once.

        Every token of the call is written first (the buffer holds the live old slots plus the
        call: budget + n slots for this layer, while it runs), the queries run in blocks of the
        chunk size (so a probability block is ``[chunk x (budget + n)]``) with nothing evicted
        between blocks, the policy's scores accumulate as usual, and one eviction brings every
        row back to its budget before the next layer runs. The same as a full-cache prefill
        followed by one ranking with the policy's rule; the chunk size does not change the
        result (for a policy scored by the last query, that is the call's last real query).
        """
        n = query.shape[2]
        config = self.config
        init = self._prefill_scores(query, key_new, value_new, nonpad, scaling)
        if init is None and config.policy.ranks_by_reconstruction and not self.probe.ranked:
            # the probe will rank this call: its attention mass is not needed (fused attention);
            # kvzip:question=W starts the scores at the question's attention instead
            init = self._prefill_scores(query, key_new, value_new, nonpad, scaling, config.policy.question_scores)
            if init is None:
                init = torch.zeros(key_new.shape[:3], dtype=torch.float32, device=self.device)
        self.ensure_free(n)
        out = self._read_whole(query, key_new, value_new, nonpad, scaling, sliding_window, init)
        if config.policy.ranks_by_reconstruction and not self.probe.ranked:
            self.probe.awaiting = True  # held whole: the reconstruction pass ranks it (rank_by_probe)
            return out
        if self.config.policy.evicts:
            if self.config.head_budgets == "adaptive":
                self._share_out(self.score, self.ordinal, self.valid, self.n_real, self.rank_keys())
            evict(self, n)
        self.shrink_to_budget()
        return out

    @property
    def query_block(self) -> int:
        """How many queries a whole call (late, held or a probe) attends at once: the chunk size,
        so a probability block is ``[chunk x (live + n)]`` (``LATE_BLOCK`` for ``chunk_size=1``)."""
        return self.config.chunk_size if self.config.chunk_size > 1 else LATE_BLOCK

    def _read_whole(self, query, key_new, value_new, nonpad, scaling, sliding_window, init):
        """Write and attend a whole call, nothing evicted (room for it made by the caller); the
        queries in blocks of the chunk size, so a probability block is ``[chunk x (live + n)]``."""
        n = query.shape[2]
        block = self.query_block
        outputs = []
        for start in range(0, n, block):
            stop = min(start + block, n)
            outputs.append(chunk_step(
                self, query[:, :, start:stop], key_new[:, :, start:stop], value_new[:, :, start:stop],
                None if nonpad is None else nonpad[:, start:stop], scaling, sliding_window,
                None if init is None else init[:, :, start:stop], evicts=False,
            ))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)

    # -- reconstruction (policy kvzip; core/reconstruction.py) ----------------------------------------
    def _attend_probe(self, query, key_new, value_new, new_mask, scaling, sliding_window):
        """A probe call: attend over the live slots and the probe, keep nothing, record the scores."""
        check_probe_call(new_mask, sliding_window)
        if not self.probe.awaiting:
            raise H2OError("reconstruct needs a cache that has read the prompt and not been ranked yet")
        self.tokens_seen -= key_new.shape[2]  # read, never kept: positions go on from the prompt
        block = self.query_block
        out, best = probe_attention(self, query, key_new, value_new, scaling, block, span=self.probe.span)
        torch.maximum(self.probe.best, best, out=self.probe.best)
        return out.transpose(1, 2).contiguous()

    # -- streamed prefill (core/streamed.py) --------------------------------------------------------
    def set_stream(self, part: str | None) -> None:
        """The next call is a streamed prefill's ``"hold"`` (a piece read whole) or ``"probe"`` (the
        prompt's last tokens ranking it), or neither (None)."""
        if part not in (None, "hold", "probe"):
            raise ValueError(f"a streamed call is a hold, a probe or neither, not {part!r}")
        self.stream = part

    def _attend_stream_probe(self, query, key_new, value_new, new_mask, scaling, sliding_window):
        """The prompt's last tokens read on top of the held slots: attend as a prefill call would,
        rank every live slot by the mass their queries pay it (pooled in prompt order as the policy
        pools), evict to the budget, keep none of the probe's tokens."""
        check_probe_call(new_mask, sliding_window)
        if not self.is_initialized or not self.has_budget:
            raise H2OError("a streamed probe follows a piece read into the cache")
        self.to_dense()
        self.tokens_seen -= key_new.shape[2]  # read, never kept: positions go on from the piece
        block = self.query_block
        out, mass = probe_attention(self, query, key_new, value_new, scaling, block, reduce="sum")
        mass = torch.where(self.valid, mass, torch.zeros_like(mass))
        self.score.copy_(self._spans(self.config.policy.smooth_held(mass, self.ordinal, self.valid), mass,
                                     self.ordinal, self.valid))
        evict(self, self.capacity)  # any m > 1: every row down to its budget at once
        self.changed()
        return out.transpose(1, 2).contiguous()

    def start_probe(self) -> None:
        """The reconstruction pass begins: probe calls record each slot's best score from now on."""
        self.probe.best = torch.zeros(self.valid.shape, dtype=torch.float32, device=self.device)

    def take_probe_scores(self, probed: bool = True) -> None:
        """The pass is over: every live slot's score becomes its reconstruction score
        (``rank_by_probe`` evicts); ``probed`` False: no probe ran, the question's attention ranks."""
        best, self.probe.best = self.probe.best, None
        if self.config.policy.question:  # the question's attention, set by _attend_late
            best = torch.maximum(best, self.score)
        best = torch.where(self.valid, best, torch.zeros_like(best))
        question = self.score if probed and self.config.policy.question_share else None
        pooled = self.config.policy.smooth_probe(best, self.ordinal, self.valid, probed)
        # word spans raise the question's attention only: the pass scores every token of a word by
        # how the model repeats it, and spans over it lift whole filler words (policies/kvzip.py)
        pooled = pooled if probed else self._spans(pooled, best, self.ordinal, self.valid)
        if question is not None:
            pooled = pooled + self._question_picks(question)
        self.score.copy_(pooled)

    def _question_picks(self, question: torch.Tensor) -> torch.Tensor:
        """``[B, H, cap]`` 1.0 on each head's best ``question_share`` of the row's heavy slots by the
        question's attention (``question``, pooled and spanned as past ``probe_upto``), else 0:
        added to the pass's scores (probabilities, at most 1) they rank first, in each head and in
        a cache-wide split alike."""
        policy = self.config.policy
        raw = torch.where(self.valid, question, torch.zeros_like(question))
        pooled = self._spans(policy.smooth_probe(raw, self.ordinal, self.valid, False), raw, self.ordinal, self.valid)
        pooled = pooled.masked_fill(~self.valid, -1.0)
        picks = (self.ranked_heavy().float() * policy.question_share).long()  # [B]
        return ((head_places(pooled) < picks[:, None, None]) & self.valid).float()

    def stop_probe(self) -> None:
        self.probe.best = None

    def ranking(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key, candidate)`` ``[B, H, cap]`` of this layer's slots (``_rank``)."""
        return self._rank(self.score, self.ordinal, self.valid, self.n_real, self.rank_keys())

    def rank_keys(self) -> torch.Tensor | None:
        """The keys a policy's rank reads: the held keys for a policy that ranks by them (``rkv``),
        dequantized where the slots are quantized; None where no rank reads them (then nothing is
        dequantized for it)."""
        if self.coding is not None and not self.config.policy.ranks_by_keys:
            return None
        return self.float_keys()

    def rank_by_probe(self, head_heavy=None) -> None:
        """Evict to the budget once, by the probe's scores (``take_probe_scores``); ``head_heavy``
        ``[B, H]``: this layer's share of a cache-wide allocation (``head_budgets="layers"``)."""
        self.probe.awaiting, self.probe.ranked = False, True
        self.heavy = self.ranked_heavy()
        if head_heavy is not None:
            self._set_head_heavy(head_heavy)
        elif self.config.head_budgets == "adaptive":
            self._share_out(self.score, self.ordinal, self.valid, self.n_real, self.rank_keys())
        evict(self, self.capacity)  # any m > 1: every row down to its budget at once
        self.shrink_to_budget()
        # what is read after the ranking (question, answer) is kept whole for ``tail`` tokens: the
        # recent window grows by that much, the slots as the tokens come (kvzip.py); above the
        # budget, unless the ranking made room for them inside it (``ranked_heavy``)
        policy = self.config.policy
        self.recent = self.recent + policy.tail
        self.probe.tail_slots = policy.slots_above_budget
        self.changed()

    def ranked_heavy(self) -> torch.Tensor:
        """``[B]``: the heavy slots the reconstruction ranking keeps: the budget's, less kvzip's
        tail where the tail counts inside the budget (``kvzip:tail_in_budget=1``), never fewer
        than the sinks (the rule that always leaves a candidate to evict)."""
        policy = self.config.policy
        if not policy.tail_in_budget:
            return self.heavy
        return torch.maximum(self.heavy - policy.tail, self.sinks)

    # -- head-adaptive budgets (head_budget.py) --------------------------------------------------
    def _rank(self, score, ordinal, live, n_real, keys) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key, candidate)`` ``[B, H, N]``: the policy's rank of ``score`` (with ``ordinal``,
        ``live`` and the tokens' ``keys`` ``[B, H, N, D]``, once ``n_real`` tokens have been read)
        and which tokens it may choose from (live, outside the recent window and the sinks)."""
        rows = (-1, 1, 1)
        key = policy_key(self.config.policy, self.layer_idx, score, ordinal, n_real.view(rows), keys, live)
        candidate = live & ~protected(ordinal, (n_real - self.recent).view(rows), self.sinks.view(rows))
        return key, candidate

    def _share_out(self, score, ordinal, live, n_real, keys) -> None:
        """Share the layer's heavy slots out among its heads by the policy's rank (``_rank``)."""
        key, candidate = self._rank(score, ordinal, live, n_real, keys)
        self._set_head_heavy(allocate(key, candidate, self.heavy, self.sinks, self.config.head_floor))

    def _share_out_upfront(self, key_new, nonpad, init) -> None:
        """Chunked prefill of a call the policy ranks whole before it is chunked (``init``: its
        look-ahead scores; else the keys' own scores): the shares are fixed before the first chunk
        is evicted, from the live slots and the call's tokens, as they will stand at its end."""
        fresh = init if init is not None else self.config.policy.key_scores(key_new)
        b, h, n = key_new.shape[:3]
        real = torch.ones(b, n, dtype=torch.bool, device=self.device) if nonpad is None else nonpad
        n_end = self.n_real + real.sum(-1)
        ordinals = (self.n_real[:, None] + torch.arange(n, device=self.device))[:, None].expand(b, h, n)
        held = self.rank_keys()
        self._share_out(torch.cat([self.score, fresh.float()], -1), torch.cat([self.ordinal, ordinals], -1),
                        torch.cat([self.valid, real[:, None].expand(b, h, n)], -1), n_end,
                        None if held is None else torch.cat([held, key_new], 2))

    def _prefill_scores(self, query, key_new, value_new, nonpad, scaling, hook=None):
        """Let the policy rank a multi-token call before it is chunked (SnapKV); None for most.
        ``hook``: another of the policy's rankers of a whole call, same arguments (kvzip's
        ``question_scores``).

        Replaces the scores of the live old slots; returns the new tokens' ``[B, Hkv, n]``."""
        policy = self.config.policy
        if not policy.evicts:
            return None
        n = query.shape[2]
        real = nonpad.sum(-1) if nonpad is not None else torch.full((query.shape[0],), n, device=self.device)
        old_keys, old_values = self.kv()
        raw = None
        if hook is not None:
            ranked = hook(query, key_new, old_keys, self.valid, real, scaling)
        elif policy.words and policy.ranks_upfront:  # the unpooled mass too: each word's best raises its tokens (core/words.py)
            raw = policy.prefill_mass(query, key_new, old_keys, self.valid, real, scaling)
            ranked = policy.pool_call(*raw, real, self.held_in_order())
        else:
            ranked = policy.prefill_scores(query, key_new, old_keys, self.valid, real, scaling,
                                           value_new=value_new, old_values=old_values,
                                           old_in_order=self.held_in_order())
        if ranked is None:
            return None
        old, new = ranked
        if self.config.prefill == "streamed" and self.capacity:
            # the pieces streamed before were evicted (their slots are out of prompt order, which
            # the policy's pool reads them in): pool them in prompt order, as each probe did, or a
            # value of many tokens the probes kept whole loses the pieces with little mass of their own
            old = self.config.policy.smooth_held(torch.where(self.valid, old, torch.zeros_like(old)), self.ordinal,
                                                 self.valid)
        if raw is not None:  # the held slots and the call's tokens, one word across both
            old, new = self._spans_across((old, new), raw, real)
        self.score.copy_(old)
        return new

    def _spans(self, pooled, raw, ordinal, valid):
        """``pooled`` ``[B, H, N]`` (slots ``ordinal`` / ``valid``), each raised to its word's best
        ``raw`` score where the policy pools by words and the cache knows the words (``core/words.py``)."""
        record = self.rows.words
        numbers = record.of(ordinal) if record is not None else None
        return pooled if numbers is None else span_max(pooled, raw, numbers, valid)

    def _spans_across(self, pooled, raw, real):
        """``_spans`` over the live slots and the call's ``real`` ``[B]`` tokens (in the real-first
        order: ordinals from ``n_real`` on) as one set, so a word may straddle the call's start;
        ``pooled`` and ``raw``: ``(old [B, H, cap], new [B, H, n])`` each."""
        b, h, n = pooled[1].shape
        ordinals = (self.n_real[:, None] + torch.arange(n, device=self.device))[:, None].expand(b, h, n)
        fresh = (torch.arange(n, device=self.device)[None, :] < real[:, None])[:, None].expand(b, h, n)
        joined = self._spans(torch.cat(pooled, -1), torch.cat(raw, -1), torch.cat([self.ordinal, ordinals], -1),
                             torch.cat([self.valid, fresh], -1))
        cap = pooled[0].shape[-1]
        return joined[..., :cap], joined[..., cap:]

    def held_in_order(self) -> torch.Tensor:
        """``[B]``: each row's tokens read so far where every head holds all of them in its first
        slots in token order (nothing evicted yet: slot ``i`` is token ``i``), else -1."""
        held = self.n_real.view(-1, 1, 1)
        index = torch.arange(self.capacity, device=self.device)
        first = index < held
        whole = (self.valid == first) & (~first | (self.ordinal == index))
        return torch.where(whole.flatten(1).all(-1), self.n_real, torch.full_like(self.n_real, -1))

    # -- accounting ------------------------------------------------------------------------------
    def kv_bytes(self, float_itemsize: int | None = None) -> int:
        """The bytes the slots' keys and values take, quantized slots' scales included;
        ``float_itemsize``: unquantized slots counted at that element size instead of the model
        dtype's (2: what a 16-bit model would hold)."""
        if not self.is_initialized:
            return 0
        held = self.ragged if self.ragged is not None else self  # flat: each head's own slots only
        if self.coding is None:
            return sum(getattr(held, name).numel() * (float_itemsize or getattr(held, name).element_size())
                       for name in ("keys", "values"))
        names = ("keys", "values") + CODEC_TENSORS
        coded = sum(getattr(held, name).numel() * getattr(held, name).element_size() for name in names)
        return coded + self.center_bytes() + self.window_bytes(float_itemsize)

    def center_bytes(self) -> int:
        """Centered keys' means (``center_keys``): one float16 vector a row and KV head; 0 without."""
        return self.key_center.numel() * self.key_center.element_size() if self.key_center is not None else 0

    def window_bytes(self, float_itemsize: int | None = None) -> int:
        """The float window's bytes (``float_window``), in the model's dtype or ``float_itemsize``; 0 without one."""
        return sum(w.numel() * (float_itemsize or w.element_size()) for w in (self.window_keys, self.window_values)
                   if w is not None)

    def full_kv_bytes(self, dtype: torch.dtype | None = None) -> int:
        """What a plain cache would hold: every position seen, for every row and head, in the
        model's dtype or ``dtype``."""
        if not self.is_initialized:
            return 0
        b, h = self.ragged.shape[:2] if self.ragged is not None else self.keys.shape[:2]
        return b * h * self.tokens_seen * sum(self.head_dims) * (dtype or self.dtype).itemsize
