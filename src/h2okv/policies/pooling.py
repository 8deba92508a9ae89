"""Scores pooled over neighbours in prompt order, where the slots are not in prompt order.

A value of many tokens (a number read digit by digit, a UUID) must be kept whole or not at all, so
each token takes the best (or mean) score of the ``kernel`` tokens around it before a ranking.
Once a cache has evicted, its slots hold tokens out of order with gaps: the neighbours are the
live slots next to it by ordinal. kvzip's ``kernel`` pools its reconstruction scores so, and the
streamed prefill pools each probe's mass so (``core/streamed.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool_in_order(scores: torch.Tensor, ordinal: torch.Tensor, valid: torch.Tensor, kernel: int,
                  mode: str) -> torch.Tensor:
    """``scores`` ``[B, H, cap]`` of live slots, each pooled (``"max"`` or ``"avg"``) with the
    ``kernel`` live slots around it in prompt order (``ordinal``): a span of many tokens (a UUID)
    ranks as one, as the policy's pool does over a call read whole. Free slots stay 0 and are
    nobody's neighbour (they sort last)."""
    if kernel <= 1:
        return scores
    order = torch.argsort(torch.where(valid, ordinal, torch.iinfo(ordinal.dtype).max), dim=-1, stable=True)
    ranked = scores.gather(-1, order)
    b, h, n = ranked.shape
    flat = ranked.reshape(b * h, 1, n)
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        # the mean over live neighbours only: a free slot's 0 must not lower a row's last tokens
        live = valid.gather(-1, order).reshape(b * h, 1, n).to(scores.dtype)
        total = F.avg_pool1d(flat * live, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
        count = F.avg_pool1d(live, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
        pooled = total / count.clamp(min=1e-9)
    smoothed = torch.empty_like(scores).scatter_(-1, order, pooled.view(b, h, n))
    return torch.where(valid, smoothed, torch.zeros_like(smoothed))
