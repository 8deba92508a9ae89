"""Eviction: free the lowest-ranked candidates until every (sequence, head) is within budget.

Candidates are live slots outside each row's last ``recent`` real tokens and outside its first
``sinks`` tokens; the policy's ``eviction_key`` ranks them. ``sinks <= heavy`` guarantees that a
step which writes ``m`` tokens into a row at its budget always finds ``m`` candidates.
"""

from __future__ import annotations

import math

import torch


def protected(ordinal, n_real, recent, sinks) -> torch.Tensor:
    """``[B, H, cap]``: slots no policy may evict (recent window and sinks); ``n_real`` etc. are ``[B]``."""
    recent_start = (n_real - recent)[:, None, None]
    return (ordinal >= recent_start) | (ordinal < sinks[:, None, None])


def evict(layer, m: int) -> None:
    """After a step that wrote ``m`` tokens: free slots until ``layer`` is within budget again."""
    policy = layer.owner.policy
    budget = (layer.heavy + layer.recent)[:, None]  # [B, 1]
    excess = (layer.valid.sum(-1) - budget).clamp(min=0)  # [B, H]
    candidate = layer.valid & ~protected(layer.ordinal, layer.n_real, layer.recent, layer.sinks)
    key = policy.eviction_key(layer.score, layer.ordinal, layer.n_real.view(-1, 1, 1), layer.layer_idx)
    key = key.masked_fill(~candidate, math.inf)
    if m == 1:
        n_evict = 1
        _, victims = key.min(dim=-1, keepdim=True)
    else:
        n_evict = int(excess.max())
        if n_evict == 0:
            return
        _, victims = key.topk(n_evict, dim=-1, largest=False)
    rank = torch.arange(n_evict, device=layer.device)
    drop = (rank < excess[..., None]) & candidate.gather(2, victims)
    layer.valid.scatter_(2, victims, layer.valid.gather(2, victims) & ~drop)
