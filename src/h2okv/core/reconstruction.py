"""The probe of a reconstruction pass (``h2okv.reconstruction``, policy ``kvzip``): attention of
tokens that are read on top of the cache and never kept, and the score each cached slot earns.

A probe call attends exactly as a prefill call would (every live slot, plus the probe's own tokens
up to each query), so the model's hidden states through the probe are those of a full cache
reading the same text. Nothing is written: the probe's keys and values live only for the call.
Each live slot's score is the largest probability any probe query of its KV head's query group
gives it (KVzip's max over the group and the queries). The queries run in blocks, so a
probability block is ``[block x (capacity + probe)]``.
"""

from __future__ import annotations

import torch

from h2okv.errors import H2OError


def probe_attention(layer, query, key_new, value_new, scaling: float, block: int):
    """``(out [B, Hq, n, Dv], best [B, Hkv, cap])`` of a probe call over ``layer``'s live slots."""
    b, hq, n, d = query.shape
    hkv, cap = key_new.shape[1], layer.capacity
    g = hq // hkv
    keys = torch.cat([layer.keys, key_new], dim=2)
    values = torch.cat([layer.values, value_new], dim=2)
    live = layer.valid[:, :, None, :]  # [B, Hkv, 1, cap]
    best = torch.zeros(b, hkv, cap, dtype=torch.float32, device=query.device)
    outputs = []
    for start in range(0, n, block):
        stop = min(start + block, n)
        m = stop - start
        q = query[:, :, start:stop].reshape(b, hkv, g * m, d)  # query head kv*g + j serves KV head kv
        logits = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scaling).view(b, hkv, g, m, cap + n)
        sees_new = torch.arange(n, device=query.device) <= torch.arange(start, stop, device=query.device)[:, None]
        allowed = torch.cat([live.expand(b, hkv, m, cap), sees_new.expand(b, hkv, m, n)], dim=-1)
        logits.masked_fill_(~allowed[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        best = torch.maximum(best, probs[..., :cap].amax(dim=(2, 3)))
        out = torch.matmul(probs.view(b, hkv, g * m, cap + n).to(values.dtype), values)
        outputs.append(out.view(b, hq, m, values.shape[-1]))
    return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0], best


def check_probe_call(new_mask, sliding_window) -> None:
    """A probe has no padding (every row reads the same probe) and no sliding window."""
    if new_mask is not None and not bool(new_mask.to(torch.bool)[:, 0].diagonal(dim1=-2, dim2=-1).all()):
        raise H2OError("a reconstruction probe cannot be padded: every row's prompt must have the same length")
    if sliding_window is not None:
        raise H2OError("reconstruction (kvzip) does not support models with sliding-window attention")
