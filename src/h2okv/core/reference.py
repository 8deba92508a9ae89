"""Algorithm 1 of the H2O paper (Zhang et al., NeurIPS 2023) as a plain loop: the specification.

Nothing here is fast, and nothing here is used at run time. It is the rule written the way the
paper states it, for one sequence and one KV head, with a list of kept token indices and a dict
of scores. The cache's paths (``step.chunk_step``, the steppers of ``decode.py``, ``scan.token_scan``) are
held to it by the tests (``tests/core/test_algorithm.py``): the same kept tokens, the same
attention outputs.

Algorithm 1, budget ``heavy + recent``::

    for each new token i:
        attend over the kept tokens and i; every token j it sees receives probability mass p_ij
        score(j) += p_ij
        while more than heavy + recent tokens are kept:
            free the candidate with the lowest score
            (candidates: kept tokens that are not among the last `recent` seen)

What the cache adds, spelled out below:

- the query heads that share a KV head (grouped-query attention) all add their mass to it;
- tokens arrive in forward calls, and a call of several tokens is read in chunks of ``chunk``:
  a query sees the kept tokens and its chunk's tokens up to itself, and eviction runs after the
  chunk (``chunk=1`` is the paper's loop; a call of one token is always a chunk of one);
- a policy (``h2okv.policies``) fills in the rule through its hooks: how the budget is split
  (``split``), how many first tokens are never evicted (``sink_tokens``), which queries of a chunk
  count (``score_queries``) and how their mass folds into the score (``accumulate``), the rank by
  which the lowest candidate goes (``eviction_key``; for ``h2o`` the score itself), optionally
  the scores of a whole call before it is chunked (``prefill_scores``, SnapKV) and the score a
  token starts with (``key_scores``, Knorm), and whether the heads share one kept list
  (``shared_heads``: the lowest mean key over the heads goes); a policy whose key reads every
  kept token's key (``ranks_by_keys``, R-KV's redundancy) ranks once per eviction and frees the
  lowest of that ranking together;
- late prefill (``late=True``): a call of several tokens is read whole and ranked once at its end;
- head-adaptive budgets (``adaptive=FLOOR``, Ada-KV): when a call has been ranked whole (late, or
  up front by ``prefill_scores``/``key_scores``), the heads' heavy slots are shared out anew:
  each head first takes its own best ``FLOOR`` share of a uniform head's choice, then the best
  candidates of all heads take the rest (``share_out`` below).

``random`` has no loop form: its draws follow the buffer's shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from h2okv.policies import Policy, make_policy


@dataclass(frozen=True)
class Reading:
    """How the loop reads one sequence: the budget ``heavy + recent`` (split by the policy), the
    forward ``calls`` (``(start, stop)`` token ranges), each read in chunks of ``chunk``, the
    attention ``scale``; ``late``: a call of several tokens is read whole (no eviction inside it)
    and ranked once at its end; ``adaptive``: head-adaptive budgets with that floor."""

    heavy: int
    recent: int
    calls: Sequence[tuple[int, int]]
    chunk: int = 1
    scale: float = 1.0
    late: bool = False
    adaptive: float | None = None


def reference_heads(q, k, v, policy: str | Policy, reading: Reading):
    """Every KV head of one sequence in lock-step, read as ``reading`` says: ``q`` ``[Hkv, g, n, D]``,
    ``k`` ``[Hkv, n, D]``, ``v`` ``[Hkv, n, Dv]``. Each head keeps its own tokens and scores, except
    under a head-shared policy (``heads=shared``), where one list is kept and the lowest mean key
    over heads goes. Returns ``(out [Hkv, g, n, Dv] float64, kept per head)``."""
    chunk, scale, late, adaptive = reading.chunk, reading.scale, reading.late, reading.adaptive
    policy = make_policy(policy)
    hkv = k.shape[0]
    budget = policy.split(reading.heavy, reading.recent) if policy.evicts else None
    sinks = min(policy.sink_tokens, budget.heavy) if budget else 0
    totals = [budget.total] * hkv if budget else None  # slots per head
    out = torch.zeros(hkv, q.shape[1], q.shape[2], v.shape[-1], dtype=torch.float64)
    kept: list[list[int]] = [[] for _ in range(hkv)]
    score: list[dict[int, float]] = [{} for _ in range(hkv)]
    for c0, c1 in reading.calls:
        ranked_upfront = c1 - c0 > 1 and (chunk > 1 or late)
        upfront = [call_scores(policy, q[h], k[h], v[h], kept[h], c0, c1, scale) if ranked_upfront else None
                   for h in range(hkv)]
        for h in range(hkv):
            if upfront[h] is not None:
                score[h].update((j, upfront[h][j]) for j in kept[h])
        if adaptive is not None and ranked_upfront and not late:
            # the call ranked before it is chunked: by the look-ahead, else by each key alone
            ranks = [upfront[h] if upfront[h] is not None
                     else {**score[h], **{j: start_score(policy, k[h, j]) for j in range(c0, c1)}} for h in range(hkv)]
            tokens = [kept[h] + list(range(c0, c1)) for h in range(hkv)]
            totals = share_out(policy, ranks, tokens, budget, sinks, c1, adaptive, k)
        step = (c1 - c0 if late else chunk) if c1 - c0 > 1 else 1
        for start in range(c0, c1, step):
            stop = min(start + step, c1)
            new = list(range(start, stop))
            for h in range(hkv):
                mass = attend(policy, q[h], k[h], v[h], kept[h], start, stop, scale, out[h])
                for j in new:
                    score[h][j] = upfront[h][j] if upfront[h] is not None else start_score(policy, k[h, j])
                kept[h] += new
                if policy.needs_scores and upfront[h] is None:
                    fold(policy, score[h], kept[h], mass)
            if adaptive is not None and late and c1 - c0 > 1 and stop == c1:
                totals = share_out(policy, score, kept, budget, sinks, stop, adaptive, k)
            if budget is not None and (stop == c1 or not late):
                evict_lowest(policy, score, kept, budget, sinks, stop, totals, k)
    return out, [sorted(heads) for heads in kept]


def attend(policy: Policy, q, k, v, kept: list[int], start: int, stop: int, scale: float, out) -> dict:
    """Queries ``start..stop-1`` of one KV head's group over its kept tokens and the chunk up to
    themselves; writes ``out`` ``[g, n, Dv]``, returns the mass ``{token: p}`` the policy counts."""
    mass: dict[int, float] = {}
    for i in range(start, stop):
        visible = kept + list(range(start, i + 1))
        for head in range(q.shape[0]):
            p = torch.softmax((k[visible] @ q[head, i]).double() * scale, dim=0)
            out[head, i] = p @ v[visible].double()
            if policy.score_queries == "all" or i == stop - 1:
                for j, p_j in zip(visible, p.tolist(), strict=True):
                    mass[j] = mass.get(j, 0.0) + p_j
    return mass


def start_score(policy: Policy, key) -> float:
    """The score a token starts with: from its key (``key_scores``, Knorm), else zero."""
    fresh = policy.key_scores(key[None, None, None])
    return 0.0 if fresh is None else float(fresh.reshape(()))


def evict_lowest(policy: Policy, score: list[dict], kept: list[list[int]], budget, sinks: int, seen: int,
                 totals: list[int], k=None) -> None:
    """Free the lowest candidates until every head ``h`` holds ``totals[h]`` tokens (candidates:
    kept tokens outside the sinks and the last ``recent`` of the ``seen``; ``k`` ``[Hkv, n, D]``:
    the keys, for a policy that ranks with them).

    A policy whose key of a token depends only on that token frees the lowest one at a time. One
    that ranks with the keys (``ranks_by_keys``, ``rkv``) gives a token a key that depends on every
    token kept, so an eviction ranks once and frees the lowest of that one ranking, as many as the
    head holds too many (R-KV selects its kept set in one ranking; so does the cache)."""
    for h in range(len(kept)):
        while len(kept[h]) > totals[h]:
            candidates = [j for j in kept[h] if sinks <= j < seen - budget.recent]
            at_once = len(kept[h]) - totals[h] if policy.ranks_by_keys else 1
            if policy.shared_heads:
                # one list for all heads: the lowest mean key goes from every head
                keys = torch.stack([rank_keys(policy, score[x], candidates, seen, kept[x], k[x] if k is not None else None)
                                    for x in range(len(kept))])
                for victim in lowest(keys.mean(0), candidates, at_once):
                    for heads in kept:
                        heads.remove(victim)
            else:
                keys = rank_keys(policy, score[h], candidates, seen, kept[h], k[h] if k is not None else None)
                for victim in lowest(keys, candidates, at_once):
                    kept[h].remove(victim)


def lowest(keys, candidates: list[int], count: int) -> list[int]:
    """The ``count`` candidates of the lowest keys (of equal keys, the first listed)."""
    order = sorted(range(len(candidates)), key=lambda a: float(keys[a]))
    return [candidates[a] for a in order[:count]]


def share_out(policy: Policy, score: list[dict], tokens: list[list[int]], budget, sinks: int, seen: int,
              floor: float, k=None) -> list[int]:
    """Ada-KV's shares once ``seen`` tokens are read: each head's slot total. A uniform head chooses
    ``heavy - sinks`` candidates; each head first takes its own best ``floor`` of that, then the
    best remaining candidates of all heads (ties: lower head first) until every head's choices add
    up to ``heads x (heavy - sinks)``; when the candidates are fewer, the spare slots go evenly."""
    heads = len(tokens)
    choice = max(budget.heavy - sinks, 0)
    first = int(choice * floor)
    picks, rest = [0] * heads, []
    for h in range(heads):
        candidates = [j for j in tokens[h] if sinks <= j < seen - budget.recent]
        keys = rank_keys(policy, score[h], candidates, seen, tokens[h], k[h] if k is not None else None)
        ranked = sorted(zip(keys.tolist(), candidates, strict=True),
                        key=lambda pair: -pair[0])
        picks[h] = min(first, len(ranked))
        rest += [(-value, h) for value, _ in ranked[picks[h]:]]
    for _, h in sorted(rest)[:max(0, min(heads * choice, sum(picks) + len(rest)) - sum(picks))]:
        picks[h] += 1
    spare = heads * choice - sum(picks)
    return [sinks + picks[h] + spare // heads + (h < spare % heads) + budget.recent for h in range(heads)]


def fold(policy: Policy, score: dict, tokens: list[int], mass: dict) -> None:
    """The policy's ``accumulate`` over ``tokens`` (``h2o`` adds the mass, ``tova`` replaces)."""
    folded = torch.tensor([score[j] for j in tokens], dtype=torch.float64)
    policy.accumulate(folded, torch.tensor([mass.get(j, 0.0) for j in tokens], dtype=torch.float64))
    score.update(zip(tokens, folded.tolist(), strict=True))


def rank_keys(policy: Policy, score: dict, candidates: list[int], seen: int, live: list[int] | None = None,
              k=None) -> torch.Tensor:
    """The policy's eviction key of each candidate once ``seen`` tokens have been read (lowest goes).

    A policy that ranks with the keys (``ranks_by_keys``, ``rkv``) keys a token by all the tokens
    kept: it is handed every ``live`` token (its score, ordinal and key ``k[j]``), and each
    candidate's key is then read from that one ranking."""
    if not policy.ranks_by_keys:
        return policy.eviction_key(
            torch.tensor([score[j] for j in candidates], dtype=torch.float64),
            torch.tensor(candidates), torch.tensor(seen),
        )
    everyone = policy.eviction_key(
        torch.tensor([score[j] for j in live], dtype=torch.float64), torch.tensor(live), torch.tensor(seen),
        keys=torch.stack([k[j].double() for j in live]), valid=torch.ones(len(live), dtype=torch.bool),
    )
    key_of = {j: everyone[a] for a, j in enumerate(live)}
    return torch.stack([key_of[j] for j in candidates]) if candidates else everyone[:0]


def call_scores(policy: Policy, q, k, v, kept: list[int], c0: int, c1: int, scale: float) -> dict | None:
    """Scores the policy gives the kept tokens and a whole call ``c0..c1`` before it is chunked
    (SnapKV, Expected Attention), as ``{token: score}``; None for a policy that scores chunk by chunk."""
    ranked = policy.prefill_scores(
        q[None, :, c0:c1], k[None, None, c0:c1], k[None, None, kept],
        torch.ones(1, 1, len(kept), dtype=torch.bool), torch.tensor([c1 - c0]), scale,
        value_new=v[None, None, c0:c1], old_values=v[None, None, kept],
        old_in_order=torch.tensor([len(kept) if kept == list(range(len(kept))) else -1]),
    )
    if ranked is None:
        return None
    old, new = ranked
    return dict(zip(kept + list(range(c0, c1)), old[0, 0].tolist() + new[0, 0].tolist(), strict=True))


def reference(q, k, v, policy: str | Policy, heavy: int, recent: int, calls=None, **reading):
    """Every KV head of one sequence: ``q`` ``[Hq, n, D]``, ``k``/``v`` ``[Hkv, n, D]``; ``calls``
    defaults to one call of all ``n`` tokens; ``reading``: ``Reading``'s other fields by keyword
    (``chunk=``, ``scale=``, ``late=``: each call ranked once, at its end; ``adaptive=``). Returns
    ``(out [Hq, n, Dv], kept per KV head)``."""
    hkv, n = k.shape[0], k.shape[1]
    g = q.shape[0] // hkv
    calls = calls if calls is not None else [(0, n)]
    out, kept = reference_heads(q.reshape(hkv, g, *q.shape[1:]), k, v, policy, Reading(heavy, recent, calls, **reading))
    return out.reshape(hkv * g, *out.shape[2:]), kept
