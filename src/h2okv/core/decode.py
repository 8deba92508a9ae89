"""The decode step of a layer: one real token per row, chosen once per layer as a *stepper*.

A forward call of one token per row, no padding and no sliding window reaching back (a plain
``generate`` step) is the hot path: it runs for every layer of every token. What it can skip
depends on state that changes rarely (when a prompt has been read, when rows join or leave), so
the engine is chosen when that state changes (``choose_stepper``, called by ``SlotLayer.refresh``)
and each stepper owns what it reuses between steps; a step asks nothing again.

- ``FillingStep``: rows still filling up to their budget (or a policy that keeps everything):
  write into the first free slot, attend over the live slots, evict by the general rule
  (``step.evict``), and once every row holds exactly its budget, choose again. The steps in which
  no row can reach past its budget (counted when the stepper is chosen) skip both.
- ``EagerStep``: every (row, head) holds exactly its budget, so each step evicts exactly one slot
  per (row, head); with one budget for all rows the buffer has budget + 1 slots and, once the new
  token is written, no free slot: attention needs no mask and the slot the eviction frees is where
  the next token goes (``AtBudget.next_free``). ~25 small tensor ops a layer.
- ``NativeStep``: the same step as one C call (CPU, float32, a rule the kernels know:
  ``native/``); uneven budgets hold each head's own slots only (``storage.py``: ragged slots).
- ``TritonStep``: the same step as one Triton launch (CUDA), at the budget or filling up
  (``triton_step.py``).
- ``TailFill``: a ranked kvzip layer of uneven head budgets filling its tail: flat, each head
  its live slots and a little room (``storage.py``: ragged slots), no eviction.
- ``GrowFirst``: a (row, head) at its budget has no free slot for the next token yet: grow once,
  choose again.

Every stepper computes the general step's slots, scores and evictions (the tests hold them to
``reference.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2okv.core import triton_step
from h2okv.core.attention import fused_mass_on, slot_attention
from h2okv.core.kernels import native_on, triton_on
from h2okv.core.native import calls as native
from h2okv.core.step import evict, eviction_rank, protected
from h2okv.core.storage import first_free

# a kvzip layer filling its tail flat (``TailFill``): the free slots each head holds ahead (a
# regrow, a copy of the layer, every this many steps)
TAIL_GROWTH = 16


@dataclass
class AtBudget:
    """What a step at the budget reuses: views that follow ``n_real`` in place, and the slot the
    last step freed."""

    dense_capacity: int  # budget + 1 when every (row, head) has the same budget, else -1
    n_real_key: torch.Tensor  # [B, 1, 1] view of n_real, for the policy's key
    recent_start: torch.Tensor  # [B, 1, 1] = n_real - recent, advanced in place
    sinks: torch.Tensor | None  # [B, 1, 1] protected first tokens, None when the policy has none
    # uneven budgets (per row or head), live slots packed at the front (``SlotStorage.pack_live``):
    # each (row, head)'s budget + 1 as [B * H] int64 and their largest; None for a uniform budget
    widths: torch.Tensor | None = None
    max_width: int = 0
    next_free: torch.Tensor | None = None

    def free_slot(self, valid: torch.Tensor) -> torch.Tensor:
        """``[B, H, 1]``: last step's victim, or (first step at the budget) the first free slot."""
        return self.next_free if self.next_free is not None else first_free(valid)


def room_range(layer) -> tuple[int, int] | None:
    """The fewest and the most slots any (row, head) of ``layer`` may still fill before it
    exceeds its budget (one device sync); None for a layer that never evicts."""
    if not layer.config.policy.evicts or not layer.has_budget:
        return None
    room = layer.slot_budget() - layer.valid.sum(-1)
    fewest, most = torch.stack((room.min(), room.max())).tolist()
    return int(fewest), int(most)


def at_budget(layer) -> AtBudget:
    """The decode state of ``layer``, every (row, head) of which is at exactly its budget
    (``room_range`` is (0, 0)). Uneven budgets also pack each head's live slots to the front."""
    budget = layer.slot_budget()
    b, h = layer.valid.shape[:2]
    uniform = bool((budget == budget[0, 0]).all())
    widths, max_width = None, 0
    if not uniform:
        # heads (or rows) of uneven budgets keep free slots. Packed, each head's live slots are its
        # first ``budget`` and its next one is free: the native step reads those and no more
        # (the eager step masks the free ones, packed or not)
        budget = budget.expand(b, h)
        packed = torch.arange(layer.capacity, device=layer.valid.device) < budget[..., None]
        if not bool((layer.valid == packed).all()):
            layer.pack_live()
        widths = (budget + 1).reshape(-1).to(torch.int64).contiguous()
        max_width = int(budget.max()) + 1
    return AtBudget(
        # uniform: each (row, head)'s one free slot, known now (a compiled step then never sees
        # None here and a tensor after: one graph from the first step)
        next_free=first_free(layer.valid) if uniform else None,
        dense_capacity=int(budget[0, 0]) + 1 if uniform else -1,
        n_real_key=layer.n_real.view(b, 1, 1),
        recent_start=(layer.n_real - layer.recent).view(b, 1, 1),
        sinks=layer.sinks.view(b, 1, 1) if bool((layer.sinks > 0).any()) else None,
        widths=widths,
        max_width=max_width,
    )


def choose_stepper(layer):
    """The stepper for ``layer``'s decode steps as its rows stand now (see the module docstring)."""
    room = room_range(layer)  # counted once: whether every row is at its budget, and how far below
    device = layer.device
    # quantized slots (core/quant.py): every step reads them through ``layer.kv()``, the C and
    # Triton steps too (their float copy: ``SlotStorage.write_token_and_read``); the flat layouts
    # (a packed layer in C, kvzip's tail) read float slots only
    kernels = not layer.config.compileable
    coded = layer.coding is not None
    triton = triton_on(device) and kernels
    fused = fused_mass_on(device) and not layer.config.compileable
    if room != (0, 0):
        if not triton and kernels and not coded and tail_fills_flat(layer, room):
            return TailFill(layer, filling_room(layer, room))
        rule = triton_step.decode_rule(layer, general=True) if triton else None
        return TritonStep(None, rule) if rule is not None else FillingStep(fused=fused, room=filling_room(layer, room))
    state = at_budget(layer)
    if layer.capacity <= layer.max_budget:  # a head holds its whole width: no slot for the next token
        return GrowFirst()
    dense = layer.capacity == state.dense_capacity
    packed = state.widths is not None and state.max_width <= layer.capacity
    if layer.config.compileable:  # tensor ops torch.compile traces; the compiler makes the kernels
        return EagerStep(state, dense)
    if (dense or (packed and not coded)) and kernels and native_on(device):
        rule = native.decode_rule(layer)
        if rule is not None:
            if packed:  # each head's own slots only, from now on
                state.next_free = first_free(layer.valid)
                layer.flatten(state.widths)
            return NativeStep(state, rule)
    if triton:
        rule = triton_step.decode_rule(layer, general=not dense)
        if rule is not None:
            return TritonStep(state if dense else None, rule)
    return EagerStep(state, dense, fused=fused)


def tail_fills_flat(layer, room: tuple[int, int] | None) -> bool:
    """Whether ``layer`` is a ranked kvzip layer of uneven head budgets filling its tail with a
    step or more to go before any head may evict: ``TailFill`` holds it flat meanwhile."""
    if not layer.probe.ranked or filling_room(layer, room) < 1:
        return False
    budget = layer.slot_budget()
    return bool((budget != budget.flatten()[0]).any())


def filling_room(layer, room: tuple[int, int] | None) -> int:
    """The steps every (row, head) of ``layer`` can take before any may exceed its budget, from
    its ``room_range``: a step within them has nothing to evict. 0 for a policy whose ranking
    depends on how many rankings came before (``random``'s draws: ``Policy.scan_safe``), which
    ranks every step."""
    if room is None or not layer.config.policy.scan_safe:
        return 0
    return max(0, room[0])


class FillingStep:
    """Rows below their budget: the general eviction, then choose again once all are at it.
    ``room``: the first steps that cannot exceed any budget skip the eviction and the choice (a
    prompt ranked with a tail, kvzip's, fills for 256 steps: ranking and re-choosing every one of
    them made its step 1.2x the same-size reference's)."""

    def __init__(self, fused: bool = False, room: int = 0):
        self.fused = fused  # the Triton attention for the mass (core/triton_attention.py)
        self.room = room

    def decode(self, layer, query, k_new, v_new, scaling):
        layer.ensure_free(1)
        out = write_and_attend(layer, first_free(layer.valid), query, k_new, v_new,
                               scaling, masked=True, fused=self.fused)
        if self.room > 0:  # every (row, head) still within its budget: nothing to evict, no change
            self.room -= 1
        elif layer.config.policy.evicts:
            evict(layer, 1)
            layer.changed()
        return out


class TailFill:
    """A ranked kvzip layer of uneven head budgets filling its tail (tokens read after the
    ranking are kept whole, nothing is evicted for ``room`` steps): the dense layout would hold
    the widest head's width for every head (issue 58: 39% of a full cache's KV at a 20% budget,
    live tokens 21%), so the layer is flat meanwhile (``storage.py``: ragged slots), each head its
    live slots packed in front and at most ``TAIL_GROWTH`` free ones, grown (``regrow``) when
    they are used up. Once the room is used, the layer goes dense and the stepper is chosen again
    (at the budget: the native step flattens it to budget + 1 a head). The step is
    ``FillingStep``'s without an eviction; attention depends on no free slot, so the same."""

    def __init__(self, layer, room: int):
        self.room = room
        live = layer.valid.sum(-1)  # [B, H]
        self.budget = layer.slot_budget().expand_as(live).reshape(-1).to(torch.int64)
        self.fill = live.reshape(-1).to(torch.int64)  # live slots per (row, head), packed in front
        layer.pack_live()
        layer.flatten(self.fill.clone())
        self.grow(layer)

    def grow(self, layer) -> None:
        """Up to ``TAIL_GROWTH`` free slots a head, never past its budget; ``left``: the steps
        until a head has none (every head takes one slot a step)."""
        widths = (self.fill + (self.budget - self.fill).clamp(0, TAIL_GROWTH)).contiguous()
        layer.regrow(widths)
        self.left = int((widths - self.fill).min())
        self.owner = torch.repeat_interleave(torch.arange(len(widths), device=widths.device), widths,
                                             output_size=int(layer.ragged.keys.shape[0]))

    def decode(self, layer, query, k_new, v_new, scaling):
        if self.left < 1:
            self.grow(layer)
        policy, ragged = layer.config.policy, layer.ragged
        b, hkv, _, d = k_new.shape
        slot = ragged.base + self.fill
        ragged.keys[slot] = k_new.reshape(b * hkv, d)
        ragged.values[slot] = v_new.reshape(b * hkv, v_new.shape[-1])
        ragged.ordinal[slot] = layer.n_real.repeat_interleave(hkv)
        fresh = policy.key_scores(k_new)
        ragged.score[slot] = 0.0 if fresh is None else fresh.reshape(-1).float()
        ragged.valid[slot] = True
        out, mass = flat_attention(query, ragged, self.owner, scaling, policy.needs_scores)
        if mass is not None:
            policy.accumulate(ragged.score, mass)
        layer.n_real.add_(1)
        self.fill += 1
        self.left -= 1
        self.room -= 1
        if self.room == 0:  # a head may evict from the next step on: dense, and choose again
            layer.to_dense()
            layer.changed()
        return out


def flat_attention(query, ragged, owner, scaling: float, need_mass: bool):
    """One query per (row, query head) over a flat layer's live slots (``owner``: each flat slot's
    (row, KV head)): ``([B, 1, Hq, Dv], mass [T] or None)``, the mass summed over each KV head's
    group as ``slot_attention``'s."""
    b, hq, _, d = query.shape
    pairs = len(ragged.widths)
    g = hq // (pairs // b)
    q = query.reshape(pairs, g, d)[owner]  # [T, g, D]
    logits = (q @ ragged.keys[:, :, None]).squeeze(-1).float().mul_(scaling)  # [T, g]
    logits.masked_fill_(~ragged.valid[:, None], float("-inf"))
    index = owner[:, None].expand_as(logits)
    top = logits.new_full((pairs, g), float("-inf")).scatter_reduce_(0, index, logits, "amax")
    probs = (logits - top[owner]).exp_()
    probs.div_(logits.new_zeros((pairs, g)).index_add_(0, owner, probs)[owner])
    values = ragged.values
    out = values.new_zeros((pairs, g, values.shape[-1])).index_add_(
        0, owner, probs.to(values.dtype)[:, :, None] * values[:, None, :])
    return out.view(b, 1, hq, values.shape[-1]), probs.sum(-1) if need_mass else None


class GrowFirst:
    """No free slot for the next token yet: one growth, then the at-budget stepper."""

    def decode(self, layer, query, k_new, v_new, scaling):
        layer.ensure_free(1)
        layer.changed()
        return layer.stepper.decode(layer, query, k_new, v_new, scaling)


class EagerStep:
    """At the budget, in tensor ops: the rule of ``step.evict`` with exactly one victim per (row, head)."""

    def __init__(self, state: AtBudget, dense: bool, fused: bool = False):
        self.state, self.dense, self.fused = state, dense, fused

    def decode(self, layer, query, k_new, v_new, scaling):
        state, policy = self.state, layer.config.policy
        slot = state.free_slot(layer.valid) if self.dense else first_free(layer.valid)
        out = write_and_attend(layer, slot, query, k_new, v_new, scaling, masked=not self.dense,
                               fused=self.fused)
        state.recent_start.add_(1)  # = n_real - recent (add_, not +=: a compiled step must not rebind it)
        shielded = protected(layer.ordinal, state.recent_start, state.sinks)
        if not self.dense:
            shielded |= ~layer.valid
        rank = eviction_rank(policy, layer.layer_idx, layer.score, layer.ordinal, state.n_real_key, shielded,
                             layer.rank_keys(), layer.valid)
        victims = rank.argmin(dim=-1, keepdim=True)
        layer.valid.scatter_(2, victims, False)
        state.next_free = victims if self.dense else None
        return out


def write_and_attend(layer, slot, query, k_new, v_new, scaling, masked: bool, fused: bool):
    """Write the token into ``slot`` ``[B, H, 1]``, attend over the live slots (``masked``: free
    slots are hidden), fold the mass into the scores and count the token; ``[B, 1, Hq, Dv]``."""
    policy = layer.config.policy
    layer.write_token(slot, k_new, v_new)
    fresh = policy.key_scores(k_new)
    layer.score.scatter_(2, slot, 0.0 if fresh is None else fresh)
    layer.valid.scatter_(2, slot, True)
    keys, values = layer.kv()
    out, mass = slot_attention(query, keys, values, layer.valid[:, :, None, :] if masked else None,
                               scaling, need_mass=policy.needs_scores, fused=fused)
    if mass is not None:
        policy.accumulate(layer.score, mass)
    layer.n_real.add_(1)
    return out.transpose(1, 2).contiguous()


class NativeStep:
    """At the budget, dense or flat, as one C call (``native/calls.py``)."""

    def __init__(self, state: AtBudget, rule: native.DecodeRule):
        self.state, self.rule = state, rule

    def decode(self, layer, query, k_new, v_new, scaling):
        return native.decode_dense(layer, self.state, query, k_new, v_new, scaling, self.rule)


class TritonStep:
    """One Triton launch a step: at the budget (``state``) or filling up (None). If the kernel
    cannot run here, the eager stepper takes over for good (``triton_step`` warns once)."""

    def __init__(self, state: AtBudget | None, rule: tuple[int, int]):
        self.state, self.rule = state, rule

    def decode(self, layer, query, k_new, v_new, scaling):
        if self.state is not None:
            out = triton_step.decode_dense(layer, self.state, query, k_new, v_new, scaling, self.rule)
            if out is not None:
                return out
            layer.stepper = EagerStep(self.state, dense=True, fused=fused_mass_on(layer.device))
        else:
            layer.ensure_free(1)  # rows filling up: room for the token first
            out = triton_step.decode_general(layer, query, k_new, v_new, scaling, self.rule)
            if out is not None:
                return out
            layer.stepper = FillingStep(fused=fused_mass_on(layer.device))
        return layer.stepper.decode(layer, query, k_new, v_new, scaling)


#: the steppers that run a step themselves (``GrowFirst`` hands its step to one of them)
STEPPERS = (FillingStep, EagerStep, NativeStep, TritonStep, TailFill)
