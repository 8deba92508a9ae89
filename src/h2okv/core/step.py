"""One step of Algorithm 1 over slot buffers: write the new tokens into free slots, attend, fold the
attention mass into the policy's scores, evict the lowest-ranked candidates.

- ``protected`` and ``eviction_rank`` are the eviction rule, defined once: a row's candidates are
  its live slots outside its last ``recent`` real tokens and its first ``sinks`` tokens, ranked by
  the policy's ``eviction_key`` (``policy_key``), lowest first. The general step, the decode steppers (``decode.py``) and
  the per-token scan (``scan.py``) all evict through them. ``sinks <= heavy`` guarantees that a
  step which writes ``m`` tokens into a row at its budget always finds ``m`` candidates.
- ``chunk_step``: the general step, for any forward call that is not a plain decode step (those
  go to the layer's stepper, ``decode.py``).

A layer (``SlotLayer``, buffers in ``storage.py``) holds per (row, KV head) ``capacity`` slots:
``keys``/``values`` ``[B, H, cap, D]``, the policy's ``score`` ``[B, H, cap]`` (float32), each
token's ``ordinal`` among its row's real tokens, and ``valid`` (the slot is live); per row
``n_real`` (real tokens seen) and the budget ``heavy``, ``recent``, ``sinks``. The plain loop
these steps compute is ``reference.py``; the tests hold each path to it.
"""

from __future__ import annotations

import math

import torch

from h2okv.core.attention import slot_attention


# -- the eviction rule -------------------------------------------------------------------------------
def protected(ordinal, recent_start, sinks=None) -> torch.Tensor:
    """Slots no policy may evict: ordinals from ``recent_start`` on (the row's recent window) and,
    when ``sinks`` is given, below ``sinks`` (its first tokens). The bounds broadcast against
    ``ordinal`` (``[B, 1, 1]`` tensors or ints); ``recent_start=None`` leaves the window out."""
    shielded = ordinal >= recent_start if recent_start is not None else torch.zeros_like(ordinal, dtype=torch.bool)
    if sinks is not None:
        shielded |= ordinal < sinks
    return shielded


def policy_key(policy, layer_idx: int, score, ordinal, n_real, keys=None, valid=None) -> torch.Tensor:
    """The policy's ``eviction_key`` of every slot; a policy that ranks with the keys
    (``ranks_by_keys``, ``rkv``) is also handed ``keys`` ``[B, H, cap, D]`` and the live slots
    ``valid`` ``[B, H, cap]``, the others are asked as they always were."""
    if policy.ranks_by_keys:
        return policy.eviction_key(score, ordinal, n_real, layer_idx, keys=keys, valid=valid)
    return policy.eviction_key(score, ordinal, n_real, layer_idx)


def eviction_rank(policy, layer_idx: int, score, ordinal, n_real, shielded, keys=None, valid=None) -> torch.Tensor:
    """The policy's rank of every slot, ``+inf`` where ``shielded``: the lowest goes first.

    ``n_real`` is ``[B, 1, 1]``: real tokens of each sequence seen so far (this step's included).
    ``keys`` and ``valid`` (the live slots) reach a policy that ranks with the keys (``policy_key``).
    A head-shared policy ranks by the mean over the layer's KV heads: every head then evicts the
    same slot, which keeps the heads' slot layouts aligned (``policies/base.py:heads_option``).
    """
    key = policy_key(policy, layer_idx, score, ordinal, n_real, keys, valid)
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
    rank = eviction_rank(layer.config.policy, layer.layer_idx, layer.score, layer.ordinal, layer.n_real.view(rows),
                         shielded, layer.rank_keys(), layer.valid)
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
    policy = layer.config.policy
    b, hkv, m, d = k_new.shape
    layer.ensure_free(m)
    cap = layer.capacity
    device = layer.device

    # the first m free slots of each (b, h), in token order
    if m == 1:
        slot_of_token = (~layer.valid).to(torch.int8).argmax(dim=-1, keepdim=True)
    else:
        slot_of_token = torch.argsort(layer.valid.to(torch.int8), dim=-1, stable=True)[..., :m]

    real = nonpad if nonpad is not None else torch.ones(b, m, dtype=torch.bool, device=device)
    ordinals = layer.n_real[:, None] + torch.arange(m, device=device)  # [B, m]
    layer.ordinal.scatter_(2, slot_of_token, ordinals[:, None, :].expand(b, hkv, m))
    layer.write_kv(slot_of_token, k_new, v_new)  # after the ordinals: centered keys are coded by them
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
    if layer.window_ordinal is None:
        keys, values = layer.kv()
    else:  # a float window: each query's own last W tokens in float (storage.banded_kv)
        keys, values, allowed = layer.banded_kv(slot_of_token, k_new, v_new, ordinals, allowed)
    out, mass = slot_attention(query, keys, values, allowed, scaling, need_mass=need_mass, query_weight=weight)
    if mass is not None and layer.window_ordinal is not None:
        mass = mass[..., :cap] + mass[..., cap:]
    if mass is not None:
        fold_mass(policy, layer.score, mass, weight)
    layer.remember_recent(ordinals, k_new, v_new, nonpad)

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
