"""The general step: write a chunk of new tokens into free slots, attend, fold the mass into the
scores, evict. Every forward call that is not a plain decode step goes through here."""

from __future__ import annotations

import torch

from h2okv.core.evict import evict
from h2okv.core.kernels import slot_attention


def last_real_query(real: torch.Tensor) -> torch.Tensor:
    """``[B, m]`` bool: each row's last real query of the chunk (real tokens come first in a row)."""
    last = real.sum(-1, keepdim=True) - 1
    return torch.arange(real.shape[1], device=real.device) == last


def chunk_step(layer, query, k_new, v_new, nonpad, scaling, sliding_window, init_scores=None):
    """One chunk of ``m`` new tokens (real tokens first in each row; ``nonpad=None``: all real).

    ``init_scores`` ``[B, Hkv, m]``: the new tokens' scores when the policy ranked the whole call
    up front (then this chunk's attention mass is not needed); else they start at zero.
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
    layer.score.scatter_(2, slot_of_token, 0.0 if init_scores is None else init_scores)

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
        policy.accumulate(layer.score, mass)

    layer.valid.scatter_(2, slot_of_token, real[:, None, :].expand(b, hkv, m))
    layer.n_real = layer.n_real + real.sum(-1)
    if policy.evicts:
        evict(layer, m)
    return out
