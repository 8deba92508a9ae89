"""The attention of a prompt's last ``window`` queries over every key they can see: what SnapKV
ranks a prompt by (``snapkv.py``: their mass summed) and what ``kvzip:question=W`` adds to the
reconstruction's scores (``kvzip.py``: their largest probability).

One ``[window x keys]`` softmax per layer, never ``prompt x prompt``: each window query attends over
the live old slots and the call's own tokens up to itself, as it did when the call was read.
"""

from __future__ import annotations

import torch


def window_probs(query, key_new, old_keys, old_valid, new_real, scaling, window):
    """``(probs [B, Hkv, g, w, cap + n], counts [B, w])``: each window query's attention
    probabilities over the old slots then the call's tokens (0 where it cannot see), and which of
    the ``w = min(window, n)`` window queries are real (a row shorter than the window has fewer).

    ``query`` ``[B, Hq, n, D]`` and ``key_new`` ``[B, Hkv, n, D]`` hold each row's real tokens first;
    ``new_real`` ``[B]`` counts them; ``old_valid`` ``[B, Hkv, cap]`` marks live old slots. The
    ``g`` query heads that share a KV head stay on their own axis: grouped-query attention without
    expanding K/V."""
    b, hq, n, d = query.shape
    hkv, cap = key_new.shape[1], old_keys.shape[2]
    g = hq // hkv
    w = min(window, n)
    pos = new_real[:, None] - w + torch.arange(w, device=query.device)  # [B, w] query index
    counts = pos >= 0
    pos = pos.clamp(min=0)
    q = query.gather(2, pos[:, None, :, None].expand(b, hq, w, d)).reshape(b, hkv, g * w, d)
    logits = torch.cat([q @ old_keys.transpose(-1, -2), q @ key_new.transpose(-1, -2)], dim=-1).float()
    logits.mul_(scaling)
    # old live slots, and the call's own tokens up to the query (causal; pads sit after it)
    sees_new = torch.arange(n, device=query.device) <= pos[:, :, None]  # [B, w, n]
    allowed = torch.cat([old_valid[:, :, None, :].expand(b, hkv, w, cap), sees_new[:, None].expand(b, hkv, w, n)], -1)
    logits.view(b, hkv, g, w, cap + n).masked_fill_(~allowed[:, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1).view(b, hkv, g, w, cap + n), counts
