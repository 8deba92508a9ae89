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
    allowed: torch.Tensor | None,  # [B, Hkv, m, cap] bool (or broadcastable on m); None: every slot
    scaling: float,
    need_mass: bool,
    query_weight: torch.Tensor | None = None,  # [B, m] bool: which queries count towards the score
):
    b, hq, m, d = query.shape
    hkv, cap = keys.shape[1], keys.shape[2]
    g = hq // hkv
    packed = query.reshape(b, hkv, g * m, d)

    if not need_mass:
        mask = None
        if allowed is not None:
            mask = allowed.expand(b, hkv, m, cap)
            if g > 1 and m > 1:  # with one query the [.., 1, cap] mask already broadcasts over the group
                mask = mask[:, :, None].expand(b, hkv, g, m, cap).reshape(b, hkv, g * m, cap)
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(b, hq, m, values.shape[-1]), None

    # in place where the tensor is fresh: on the decode path every op counts, and in a prefill
    # chunk the logits are the largest tensor there is
    logits = torch.matmul(packed, keys.transpose(-1, -2))
    if logits.dtype != torch.float32:
        logits = logits.float()
    logits.mul_(scaling)
    if allowed is not None:
        # rows are (group head, query): the [m, cap] mask broadcasts over the group, never copied
        hidden = ~allowed.expand(b, hkv, m, cap)
        logits.view(b, hkv, g, m, cap).masked_fill_(hidden[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs if probs.dtype == values.dtype else probs.to(values.dtype), values)
    if query_weight is not None:
        weight = query_weight[:, None, None, :].expand(b, 1, g, m).reshape(b, 1, g * m, 1)
        probs = probs * weight
    mass = probs.sum(dim=2)  # [B, Hkv, cap]
    return out.reshape(b, hq, m, values.shape[-1]), mass
