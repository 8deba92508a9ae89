"""One step of Algorithm 1 over slot buffers: write the new tokens into free slots, attend, fold the
attention mass into the policy's scores, evict the lowest-ranked candidates.

- ``protected`` and ``eviction_rank`` are the eviction rule, defined once: a row's candidates are
  its live slots outside its last ``recent`` real tokens and its first ``sinks`` tokens, ranked by
  the policy's ``eviction_key``, lowest first. The general step, the decode fast path below and
  the per-token scan (``scan.py``) all evict through them. ``sinks <= heavy`` guarantees that a
  step which writes ``m`` tokens into a row at its budget always finds ``m`` candidates.
- ``chunk_step``: the general step, for any forward call that is not a plain decode step.
- ``decode_step``: one real token per row, in the fewest ops once every row is at its budget (one C
  call on CPU, ``native/``); on CUDA one Triton launch whether or not the rows are at their budget
  (``triton_step.py``).

A layer (``SlotLayer``, buffers in ``storage.py``) holds per (row, KV head) ``capacity`` slots:
``keys``/``values`` ``[B, H, cap, D]``, the policy's ``score`` ``[B, H, cap]`` (float32), each
token's ``ordinal`` among its row's real tokens, and ``valid`` (the slot is live); per row
``n_real`` (real tokens seen) and the budget ``heavy``, ``recent``, ``sinks``. The plain loop
these steps compute is ``reference.py``; the tests hold each path to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from h2okv.core import triton_step
from h2okv.core.attention import slot_attention
from h2okv.core.kernels import native_on, triton_on
from h2okv.core.native import calls as native


# -- the eviction rule -------------------------------------------------------------------------------
def protected(ordinal, recent_start, sinks=None) -> torch.Tensor:
    """Slots no policy may evict: ordinals from ``recent_start`` on (the row's recent window) and,
    when ``sinks`` is given, below ``sinks`` (its first tokens). The bounds broadcast against
    ``ordinal`` (``[B, 1, 1]`` tensors or ints); ``recent_start=None`` leaves the window out."""
    shielded = ordinal >= recent_start if recent_start is not None else torch.zeros_like(ordinal, dtype=torch.bool)
    if sinks is not None:
        shielded |= ordinal < sinks
    return shielded


def eviction_rank(policy, layer_idx: int, score, ordinal, n_real, shielded) -> torch.Tensor:
    """The policy's rank of every slot, ``+inf`` where ``shielded``: the lowest goes first.

    ``n_real`` is ``[B, 1, 1]``: real tokens of each sequence seen so far (this step's included).
    A head-shared policy ranks by the mean over the layer's KV heads: every head then evicts the
    same slot, which keeps the heads' slot layouts aligned (``policies/base.py:heads_option``).
    """
    key = policy.eviction_key(score, ordinal, n_real, layer_idx)
    if policy.shared_heads:
        key = key.mean(dim=1, keepdim=True).expand_as(key)
    return key.masked_fill(shielded, math.inf)


def evict(layer, m: int) -> None:
    """After a step that wrote ``m`` tokens: free slots until ``layer`` is within budget again."""
    budget = layer.slot_budget()  # [B, 1], or [B, H] with head-adaptive budgets
    excess = (layer.valid.sum(-1) - budget).clamp(min=0)  # [B, H]
    rows = (-1, 1, 1)
    shielded = ~layer.valid | protected(layer.ordinal, (layer.n_real - layer.recent).view(rows), layer.sinks.view(rows))
    # ranked before the early return below: a random policy draws the same numbers either way
    rank = eviction_rank(layer.owner.policy, layer.layer_idx, layer.score, layer.ordinal, layer.n_real.view(rows),
                         shielded)
    if m == 1:
        n_evict = 1
        victims = rank.argmin(dim=-1, keepdim=True)
    else:
        n_evict = int(excess.max())
        if n_evict == 0:
            return
        victims = rank.topk(n_evict, dim=-1, largest=False).indices
    nth = torch.arange(n_evict, device=layer.device)
    drop = (nth < excess[..., None]) & ~shielded.gather(2, victims)
    layer.valid.scatter_(2, victims, layer.valid.gather(2, victims) & ~drop)


# -- the general step --------------------------------------------------------------------------------
def last_real_query(real: torch.Tensor) -> torch.Tensor:
    """``[B, m]`` bool: each row's last real query of the chunk (real tokens come first in a row)."""
    last = real.sum(-1, keepdim=True) - 1
    return torch.arange(real.shape[1], device=real.device) == last


def chunk_step(layer, query, k_new, v_new, nonpad, scaling, sliding_window, init_scores=None, evicts=True):
    """One chunk of ``m`` new tokens (real tokens first in each row; ``nonpad=None``: all real).

    ``init_scores`` ``[B, Hkv, m]``: the new tokens' scores when the policy ranked the whole call
    up front (then this chunk's attention mass is not needed); else the policy's ``key_scores``
    or zero. ``evicts=False`` leaves the eviction to the caller (late prefill: once per call).
    Returns ``[B, Hq, m, D]``.
    """
    policy = layer.owner.policy
    b, hkv, m, d = k_new.shape
    layer.ensure_free(m)
    cap = layer.capacity
    device = layer.device

    # the first m free slots of each (b, h), in token order
    if m == 1:
        slot_of_token = (~layer.valid).to(torch.int8).argmax(dim=-1, keepdim=True)
    else:
        slot_of_token = torch.argsort(layer.valid.to(torch.int8), dim=-1, stable=True)[..., :m]

    idx = slot_of_token[..., None]
    layer.keys.scatter_(2, idx.expand(-1, -1, -1, d), k_new)
    layer.values.scatter_(2, idx.expand(-1, -1, -1, v_new.shape[-1]), v_new)
    real = nonpad if nonpad is not None else torch.ones(b, m, dtype=torch.bool, device=device)
    ordinals = layer.n_real[:, None] + torch.arange(m, device=device)  # [B, m]
    layer.ordinal.scatter_(2, slot_of_token, ordinals[:, None, :].expand(b, hkv, m))
    fresh = init_scores if init_scores is not None else policy.key_scores(k_new)
    layer.score.scatter_(2, slot_of_token, 0.0 if fresh is None else fresh)

    # which slots each new query may see: live old slots, plus new tokens up to itself (pads
    # sit after the real tokens of their row, so a real query never sees one)
    if m == 1:
        allowed = layer.valid.scatter(2, slot_of_token, True)[:, :, None, :]
    else:
        token_of_slot = torch.full((b, hkv, cap), m, dtype=torch.long, device=device)
        token_of_slot.scatter_(2, slot_of_token, torch.arange(m, device=device).expand(b, hkv, m))
        q_idx = torch.arange(m, device=device)[:, None]  # [m, 1]
        allowed = layer.valid[:, :, None, :] | (token_of_slot[:, :, None, :] <= q_idx)
    if sliding_window is not None and int(layer.n_real.max()) + m > sliding_window:
        q_ord = ordinals[:, None, :, None]  # [B, 1, m, 1]
        allowed = allowed & (layer.ordinal[:, :, None, :] > q_ord - sliding_window)

    need_mass = policy.needs_scores and init_scores is None
    weight = nonpad
    if need_mass and policy.score_queries == "last" and m > 1:
        weight = last_real_query(real)
    out, mass = slot_attention(query, layer.keys, layer.values, allowed, scaling, need_mass=need_mass, query_weight=weight)
    if mass is not None:
        fold_mass(policy, layer.score, mass, weight)

    layer.valid.scatter_(2, slot_of_token, real[:, None, :].expand(b, hkv, m))
    layer.n_real = layer.n_real + real.sum(-1)
    if policy.evicts and evicts:
        evict(layer, m)
    return out


def fold_mass(policy, score, mass, weight) -> None:
    """``policy.accumulate``, except in rows where no query of the chunk counted (a chunk of pads
    only): their scores stay, as if the chunk had not run for them (a replacing policy, ``tova``,
    would otherwise replace them by zeros)."""
    if weight is None or bool(weight.any(-1).all()):
        policy.accumulate(score, mass)
        return
    folded = score.clone()
    policy.accumulate(folded, mass)
    score.copy_(torch.where(weight.any(-1)[:, None, None], folded, score))


# -- the decode fast path ----------------------------------------------------------------------------
# Once every (sequence, head) holds exactly its row's budget, a one-token step must evict exactly one
# slot in every (sequence, head): there are always candidates (budget + 1 live tokens with distinct
# ordinals, at most ``recent`` of them recent and ``sinks <= heavy`` of them sinks). So the step
# needs no excess counts or drop masks, and when all rows share one budget the buffer has budget + 1
# slots and, once the new token is written, no free slot: attention needs no mask and the one slot
# the eviction frees is where the next token goes. A step is ~25 small ops per layer, each costing
# microseconds of dispatch on CPU, so the op count is the cost. Same slots, scores and evictions
# as the general step (tested).
@dataclass
class FastDecode:
    """What ``decode_step`` reuses between steps while every row is at its budget."""

    valid: torch.Tensor  # the buffers this was built for (identity is checked before each use)
    n_real: torch.Tensor
    dense_capacity: int
    ordinal_src: torch.Tensor  # [B, H, 1] view of n_real: the ordinal of the token being written
    n_real_key: torch.Tensor  # [B, 1, 1] view of n_real, for the policy's key
    recent_start: torch.Tensor  # [B, 1, 1] = n_real - recent, advanced in place
    sinks: torch.Tensor | None  # [B, 1, 1] protected first tokens, None when the policy has none
    # uneven budgets (per row or head), live slots packed at the front (``SlotStorage.pack_live``): each
    # (row, head)'s budget + 1 as [B * H] int64 and their largest; None for a uniform budget
    widths: torch.Tensor | None = None
    max_width: int = 0
    next_free: torch.Tensor | None = None


def check_at_budget(layer) -> FastDecode | None:
    """Is every (sequence, head) at exactly its row's budget (one device sync)? Then the fast state.
    Budgets that differ across rows or heads also pack each head's live slots to the front and,
    where the C step will run, hold the layer flat (``go_flat``)."""
    if not layer.owner.policy.evicts or not layer.has_budget:
        return None
    budget = layer.slot_budget()
    if not bool((layer.valid.sum(-1) == budget).all()):
        return None
    b, h = layer.valid.shape[:2]
    has_sinks = bool((layer.sinks > 0).any())
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
    fast = FastDecode(
        valid=layer.valid,
        n_real=layer.n_real,
        dense_capacity=int(budget[0, 0]) + 1 if uniform else -1,
        ordinal_src=layer.n_real.view(b, 1, 1).expand(b, h, 1),  # a view: follows n_real in place
        n_real_key=layer.n_real.view(b, 1, 1),
        recent_start=(layer.n_real - layer.recent).view(b, 1, 1),
        sinks=layer.sinks.view(b, 1, 1) if has_sinks else None,
        widths=widths,
        max_width=max_width,
    )
    # the C step will decode it: hold each head's own slots from now on (a head holding its whole
    # width has no free slot yet: the next step's ensure_free grows the layer, then it goes flat)
    if (widths is not None and max_width <= layer.capacity and native_on(layer.device)
            and native.decode_rule(layer) is not None):
        go_flat(layer, fast)
    return fast


def go_flat(layer, fast: FastDecode) -> None:
    """Flatten a packed layer at budget (``storage.py``: ragged slots) for the C step."""
    if fast.next_free is None:
        fast.next_free = layer.valid.view(torch.uint8).argmin(dim=-1, keepdim=True)  # each head's free slot
    layer.flatten(fast.widths)
    fast.valid = layer.ragged.valid  # no reference left to the dense buffers


def decode_step(layer, query, k_new, v_new, scaling):
    """The general step for one real token per row and no sliding window, in the fewest ops."""
    policy = layer.owner.policy
    b, hkv, _, d = k_new.shape
    if layer.ragged is not None:  # flattened by an earlier step: stays flat while the C step runs
        rule = native.decode_rule(layer, query) if native_on(layer.device) else None
        if rule is not None:
            return native.decode_dense(layer, layer.fast, query, k_new, v_new, scaling, rule)
        layer.unflatten()
    layer.ensure_free(1)
    fast = layer.fast
    if fast is not None and (fast.valid is not layer.valid or fast.n_real is not layer.n_real):
        layer.fast = fast = check_at_budget(layer)  # the buffers were replaced (resize, rows)
    dense = fast is not None and layer.capacity == fast.dense_capacity
    packed = fast is not None and fast.widths is not None and fast.max_width <= layer.capacity
    if (dense or packed) and native_on(layer.device):
        rule = native.decode_rule(layer, query)
        if rule is not None:  # the whole step below as one C call (core/native)
            if packed:  # keep each head's own slots only (storage.py: ragged slots)
                go_flat(layer, fast)
            return native.decode_dense(layer, fast, query, k_new, v_new, scaling, rule)
    if triton_on(layer.device):
        # the whole step below as one Triton launch: at the budget (dense), or with free slots
        # (rows filling up, or room above the budget), where it also needs no live-slot count
        rule = triton_step.decode_rule(layer, general=not dense)
        if rule is not None and dense:
            out = triton_step.decode_dense(layer, fast, query, k_new, v_new, scaling, rule)
            if out is not None:
                return out
        elif rule is not None:
            out = triton_step.decode_general(layer, query, k_new, v_new, scaling, rule)
            if out is not None:
                layer.fast = None  # its window bound no longer follows n_real; check_at_budget rebuilds it
                return out
    if dense and fast.next_free is not None:
        slot = fast.next_free  # the only free slot: last step's victim
    else:
        slot = layer.valid.view(torch.uint8).argmin(dim=-1, keepdim=True)  # first free slot, [B, H, 1]
    index = slot.unsqueeze(-1).expand(b, hkv, 1, d)
    layer.keys.scatter_(2, index, k_new)
    if v_new.shape[-1] != d:
        index = slot.unsqueeze(-1).expand(b, hkv, 1, v_new.shape[-1])
    layer.values.scatter_(2, index, v_new)
    ordinal = fast.ordinal_src if fast is not None else layer.n_real.view(b, 1, 1).expand(b, hkv, 1)
    layer.ordinal.scatter_(2, slot, ordinal)
    fresh = policy.key_scores(k_new)
    layer.score.scatter_(2, slot, 0.0 if fresh is None else fresh)
    layer.valid.scatter_(2, slot, True)
    out, mass = slot_attention(
        query, layer.keys, layer.values, None if dense else layer.valid[:, :, None, :], scaling,
        need_mass=policy.needs_scores,
    )
    if mass is not None:
        policy.accumulate(layer.score, mass)
    layer.n_real += 1
    if policy.evicts:
        if fast is not None:
            # the rule of ``evict`` with m = 1: exactly one victim per (row, head), so no excess
            # counts; the window bound is advanced in place, and a dense buffer has no free slot
            fast.recent_start += 1  # = n_real - recent
            shielded = protected(layer.ordinal, fast.recent_start, fast.sinks)
            if not dense:
                shielded |= ~layer.valid
            rank = eviction_rank(policy, layer.layer_idx, layer.score, layer.ordinal, fast.n_real_key, shielded)
            victims = rank.argmin(dim=-1, keepdim=True)
            layer.valid.scatter_(2, victims, False)
            fast.next_free = victims if dense else None
        else:  # still filling up to the budget: the general eviction, then look again
            evict(layer, 1)
            layer.fast = check_at_budget(layer)
    return out.transpose(1, 2).contiguous()
