"""Per-token eviction over a whole forward call in one pass: the cheap recurrence only.

With ``chunk_size=1`` (``eval ppl``, log-likelihoods) every token is a step: attend over the live
set, add the mass to the scores, evict one. Done as ``chunk_step`` calls that is ~30 tensor ops
per token and layer, most of them bookkeeping. But within one call every key is known up front,
so this module computes the logits of a block of queries against all keys at once
(``[B, Hkv, g, block, keys]``, blocks bound the memory), runs only the recurrence per token
(``scan_block``: mask the row by the live set, softmax, fold the mass into the scores, pick the
victim: ~12 small ops), and multiplies probabilities by values once per block. ``scan_block`` is
a pure function of tensors so a fused kernel can replace it.

Keys are indexed ``[old slots..., new tokens...]``; ``bias`` is 0 for live keys and -inf else.
Each token's victim is chosen by the rule of ``step.py`` (``protected``, ``eviction_rank``) over
that layout. It produces the same kept sets and outputs as ``chunk_step`` with ``m = 1`` (tested);
slot order differs afterwards, which no result depends on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from h2okv.core.kernels import native_on
from h2okv.core.native import calls as native
from h2okv.core.step import eviction_rank, protected

# bytes of float32 logits one query block may take, and its most queries: a block's logits span
# every key up to its last query, so small blocks waste little on keys that are not written yet
BLOCK_BYTES = 64 * 2**20
BLOCK_QUERIES = 128


@dataclass
class ScanState:
    """What the recurrence carries from token to token (all ``[B, Hkv, keys]``)."""

    bias: torch.Tensor  # float32: 0 live, -inf free, evicted or not yet written
    blocked: torch.Tensor  # bool: never a candidate in this call: a free old slot, an evicted key, a sink
    score: torch.Tensor  # float32: the policy's per-key score
    ordinal: torch.Tensor  # long: the key's ordinal among its sequence's real tokens
    # [B, Hkv, keys, D], in the same layout: for a policy that ranks with the keys (``rkv``), whose
    # live keys are those of bias 0
    keys: torch.Tensor | None = None


@dataclass
class ScanPlan:
    """Per-token constants of one call (the same in every row: see ``can_scan``)."""

    first_new: int  # index of new token 0 among the keys (= old capacity)
    n0: int  # real tokens seen before the call
    recent: int
    evict_from: int  # the first step that evicts (the row is at its budget after it writes)


def scan_block(probs: torch.Tensor, state: ScanState, plan: ScanPlan, start: int, policy, layer_idx: int) -> None:
    """Run tokens ``start .. start + block - 1``: ``probs`` ``[B, Hkv, g, block, keys]`` holds their
    scaled logits on entry and their attention probabilities on return; ``state`` is advanced."""
    bias, blocked, score = state.bias, state.blocked, state.score
    evicts = policy.evicts
    # n_real after token i, as the [B, 1, 1]-broadcastable tensor the policy's key expects
    n_real = (plan.n0 + 1 + torch.arange(start, start + probs.shape[3], device=bias.device)).view(-1, 1, 1, 1)
    for t in range(probs.shape[3]):
        i = start + t
        bias[:, :, plan.first_new + i] = 0.0  # write token i
        row = probs[:, :, :, t, :]
        row += bias[:, :, None, :]
        p = torch.softmax(row, dim=-1)
        row.copy_(p)
        if policy.needs_scores:
            policy.accumulate(score, p.sum(dim=2))
        if evicts and i >= plan.evict_from:
            # the rule's window moves every token; its sinks are in ``blocked``, fixed for the call.
            # Keys not yet written are shielded by the window (their ordinals lie ahead of it).
            shielded = protected(state.ordinal, plan.n0 + i + 1 - plan.recent) | blocked
            live = bias == 0 if policy.ranks_by_keys else None
            victim = eviction_rank(policy, layer_idx, score, state.ordinal, n_real[t], shielded, state.keys,
                                   live).argmin(-1, keepdim=True)
            bias.scatter_(-1, victim, -math.inf)
            blocked.scatter_(-1, victim, True)


def can_scan(layer, nonpad, sliding_window) -> bool:
    """The scan covers calls of real tokens only, rows alike (same budget and live count)."""
    policy = layer.config.policy
    if nonpad is not None or sliding_window is not None or not policy.scan_safe:
        return False
    if not policy.evicts or layer.head_heavy is not None:
        return False
    live = layer.valid.sum(-1)
    budget = layer.heavy + layer.recent
    return bool((live == live.flatten()[0]).all()) and bool((budget == budget[0]).all()) \
        and bool((layer.n_real == layer.n_real[0]).all()) and bool((layer.sinks == layer.sinks[0]).all())


def token_scan(layer, query, key_new, value_new, scaling) -> torch.Tensor:
    """Per-token eviction over a whole call (see the module docstring); returns ``[B, Hq, n, Dv]``."""
    policy = layer.config.policy
    b, hq, n, d = query.shape
    hkv, cap = key_new.shape[1], layer.capacity
    g = hq // hkv
    device = layer.device
    window = layer.window_ordinal.shape[1] if layer.window_ordinal is not None else 0
    n0 = int(layer.n_real[0])
    new_ord = (n0 + torch.arange(n, device=device)).expand(b, hkv, n)
    if window:  # each query reads its own last W tokens in float (``storage.banded_kv``), older ones coded
        coded_keys, coded_values = layer.coded_kv()
        held_keys, held_values = layer.with_window(coded_keys, coded_values)
        _, coded_new = layer.coding.encode_and_decode_keys(key_new, layer.centering, new_ord)
        coded_keys = torch.cat([coded_keys, coded_new], dim=2)
        coded_values = torch.cat([coded_values, layer.coding.values.roundtrip(value_new)], dim=2)
    else:
        held_keys, held_values = layer.kv()
    keys = torch.cat([held_keys, key_new], dim=2)
    values = torch.cat([held_values, value_new], dim=2)
    total = cap + n
    recent, sinks = int(layer.recent[0]), int(layer.sinks[0])
    budget = int(layer.heavy[0]) + recent
    live0 = int(layer.valid[0, 0].sum())

    ordinal = torch.cat([layer.ordinal, new_ord], dim=2)
    bias = torch.full((b, hkv, total), -math.inf, device=device)
    bias[:, :, :cap].masked_fill_(layer.valid, 0.0)
    blocked = protected(ordinal, None, sinks or None)
    blocked[:, :, :cap] |= ~layer.valid
    fresh = policy.key_scores(key_new)
    score = torch.cat([layer.score, torch.zeros(b, hkv, n, device=device) if fresh is None else fresh], dim=2)
    plan = ScanPlan(cap, n0, recent, budget - live0)

    packed = query.reshape(b, hkv, g, n, d)
    block = max(1, min(n, BLOCK_QUERIES, BLOCK_BYTES // max(1, 4 * b * hq * total)))
    use_native = native_on(device)
    outs = []
    for start in range(0, n, block):
        stop = min(start + block, n)
        width = cap + stop  # later keys are not written yet
        logits = torch.matmul(packed[:, :, :, start:stop], keys[:, :, None, :width].transpose(-1, -2))
        if window:  # [B, Hkv, 1, blk, width]: the slots in each query's band read in float
            band = ordinal[:, :, None, None, :width] > (n0 + torch.arange(start, stop, device=device) - window).view(
                1, 1, 1, -1, 1)
            coded = torch.matmul(packed[:, :, :, start:stop], coded_keys[:, :, None, :width].transpose(-1, -2))
            logits = torch.where(band, logits, coded)
        logits = logits.float() if logits.dtype != torch.float32 else logits
        logits.mul_(scaling)
        sub = ScanState(bias[..., :width], blocked[..., :width], score[..., :width], ordinal[..., :width],
                        keys[:, :, :width])
        rule = native.scan_rule(policy, logits, sub) if use_native else None
        if rule is not None:
            native.scan_block(logits, sub, plan, start, policy, rule)  # the same recurrence in C
        else:
            scan_block(logits, sub, plan, start, policy, layer.layer_idx)
        probs = logits if logits.dtype == values.dtype else logits.to(values.dtype)
        if window:
            outs.append(torch.matmul(torch.where(band, probs, 0), values[:, :, None, :width])
                        + torch.matmul(torch.where(band, 0, probs), coded_values[:, :, None, :width]))
        else:
            outs.append(torch.matmul(probs, values[:, :, None, :width]))  # [B, Hkv, g, blk, Dv]
    out = torch.cat(outs, dim=3).reshape(b, hq, n, values.shape[-1])

    # back into slots: the live keys first, the buffer cut to what decode needs
    valid = bias == 0
    capacity = min(total, int(layer.max_budget) + 1)
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)[..., :capacity]
    if window:  # the slots hold codes: the coded tensors code to the same ones, the window keeps the floats
        keys, values = coded_keys, coded_values
    layer.ordinal = ordinal.gather(2, order)
    layer.store_kv(keys.gather(2, order[..., None].expand(-1, -1, -1, d)),
                   values.gather(2, order[..., None].expand(-1, -1, -1, values.shape[-1])), layer.ordinal)
    layer.score = score.gather(2, order)
    layer.valid = valid.gather(2, order)
    layer.remember_recent(new_ord[:, 0], key_new, value_new)
    layer.n_real = layer.n_real + n
    layer.peak_capacity = max(layer.peak_capacity, total)
    return out
