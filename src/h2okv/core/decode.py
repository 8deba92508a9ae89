"""The decode fast path: one real token per row, every row at its budget.

Once every (sequence, head) holds exactly its row's budget, a one-token step must evict exactly one
slot in every (sequence, head): there are always candidates (budget + 1 live tokens with distinct
ordinals, at most ``recent`` of them recent and ``sinks <= heavy`` of them sinks). So the step
needs no excess counts or drop masks, and when all rows share one budget the buffer has budget + 1
slots and, once the new token is written, no free slot: attention needs no mask and the one slot
the eviction frees is where the next token goes. A step is ~25 small ops per layer, each costing
microseconds of dispatch on CPU, so the op count is the cost. Same slots, scores and evictions
as the general step (tested).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from h2okv.core.evict import evict
from h2okv.core.kernels import slot_attention


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
    next_free: torch.Tensor | None = None


def check_at_budget(layer) -> FastDecode | None:
    """One device sync: is every (sequence, head) at exactly its row's budget? Then the fast state."""
    if not layer.owner.policy.evicts or not layer.has_budget:
        return None
    budget = layer.heavy + layer.recent
    if not bool((layer.valid.sum(-1) == budget[:, None]).all()):
        return None
    b, h = layer.valid.shape[:2]
    has_sinks = bool((layer.sinks > 0).any())
    return FastDecode(
        valid=layer.valid,
        n_real=layer.n_real,
        dense_capacity=int(budget[0]) + 1 if bool((budget == budget[0]).all()) else -1,
        ordinal_src=layer.n_real.view(b, 1, 1).expand(b, h, 1),  # a view: follows n_real in place
        n_real_key=layer.n_real.view(b, 1, 1),
        recent_start=(layer.n_real - layer.recent).view(b, 1, 1),
        sinks=layer.sinks.view(b, 1, 1) if has_sinks else None,
    )


def decode_step(layer, query, k_new, v_new, scaling):
    """The general step for one real token per row and no sliding window, in the fewest ops."""
    policy = layer.owner.policy
    b, hkv, _, d = k_new.shape
    layer.ensure_free(1)
    fast = layer.fast
    if fast is not None and (fast.valid is not layer.valid or fast.n_real is not layer.n_real):
        layer.fast = fast = check_at_budget(layer)  # the buffers were replaced (resize, rows)
    dense = fast is not None and layer.capacity == fast.dense_capacity
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
    layer.score.scatter_(2, slot, 0.0)
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
            fast.recent_start += 1  # = n_real - recent
            key = policy.eviction_key(layer.score, layer.ordinal, fast.n_real_key, layer.layer_idx)
            shielded = layer.ordinal >= fast.recent_start
            if fast.sinks is not None:
                shielded |= layer.ordinal < fast.sinks
            if not dense:
                shielded |= ~layer.valid
            victims = key.masked_fill(shielded, math.inf).argmin(dim=-1, keepdim=True)
            layer.valid.scatter_(2, victims, False)
            fast.next_free = victims if dense else None
        else:  # still filling up to the budget: the general eviction, then look again
            evict(layer, 1)
            layer.fast = check_at_budget(layer)
    return out.transpose(1, 2).contiguous()
