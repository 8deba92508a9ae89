"""Attention over slot buffers, returning the probability mass each slot received.

Grouped-query attention without expanding K/V: the ``g`` query heads that share a KV head are
packed into the query-length axis, ``[B, Hkv, g*m, D]``, so one batched matmul per KV head serves
them all, and summing the probabilities over that axis gives exactly the per-KV-head score H2O
accumulates (the group's heads summed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def slot_attention(
    query: torch.Tensor,  # [B, Hq, m, D]
    keys: torch.Tensor,  # [B, Hkv, cap, D]
    values: torch.Tensor,  # [B, Hkv, cap, Dv]
    allowed: torch.Tensor,  # [B, Hkv, m, cap] bool (or broadcastable on m)
    scaling: float,
    need_mass: bool,
    query_weight: torch.Tensor | None = None,  # [B, m] bool: which queries count towards the score
):
    b, hq, m, d = query.shape
    hkv, cap = keys.shape[1], keys.shape[2]
    g = hq // hkv
    packed = query.reshape(b, hkv, g * m, d)
    mask = allowed.expand(b, hkv, m, cap)
    if g > 1:
        mask = mask[:, :, None].expand(b, hkv, g, m, cap).reshape(b, hkv, g * m, cap)

    if not need_mass:
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(b, hq, m, values.shape[-1]), None

    logits = torch.matmul(packed, keys.transpose(-1, -2)).float() * scaling
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs.to(values.dtype), values)
    if query_weight is not None:
        weight = query_weight[:, None, None, :].expand(b, 1, g, m).reshape(b, 1, g * m, 1)
        probs = probs * weight
    mass = probs.sum(dim=2)  # [B, Hkv, cap]
    return out.reshape(b, hq, m, values.shape[-1]), mass
