"""Algorithm 1 of the H2O paper (Zhang et al., NeurIPS 2023) as a plain loop: the specification.

Nothing here is fast, and nothing here is used at run time. It is the rule written the way the
paper states it, for one sequence and one KV head, with a list of kept token indices and a dict
of scores. The cache's paths (``step.chunk_step``, ``step.decode_step``, ``scan.token_scan``) are
held to it by the tests (``tests/test_core_algorithm.py``): the same kept tokens, the same
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
  which the lowest candidate goes (``eviction_key``; for ``h2o`` the score itself), and optionally
  the scores of a whole call before it is chunked (``prefill_scores``, SnapKV).

``random`` has no loop form: its draws follow the buffer's shape.
"""

from __future__ import annotations

import torch

from h2okv.policies import Policy, make_policy


def reference_head(q, k, v, policy: str | Policy, heavy: int, recent: int, calls, chunk: int, scale: float):
    """One sequence, one KV head. ``q`` ``[g, n, D]``: the query heads that share this KV head;
    ``k`` ``[n, D]``, ``v`` ``[n, Dv]``; ``calls``: the forward calls as ``[(start, stop), ...]``.

    Returns ``(out, kept)``: ``out`` ``[g, n, Dv]`` (float64), ``kept`` the sorted kept tokens.
    """
    policy = make_policy(policy)
    budget = policy.split(heavy, recent) if policy.evicts else None
    sinks = min(policy.sink_tokens, budget.heavy) if budget else 0
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    kept: list[int] = []
    score: dict[int, float] = {}
    for c0, c1 in calls:
        upfront = call_scores(policy, q, k, kept, c0, c1, scale) if c1 - c0 > 1 and chunk > 1 else None
        if upfront is not None:
            score.update((j, upfront[j]) for j in kept)
        step = chunk if c1 - c0 > 1 else 1
        for start in range(c0, c1, step):
            stop = min(start + step, c1)
            new = list(range(start, stop))
            mass: dict[int, float] = {}
            for i in new:
                visible = kept + list(range(start, i + 1))
                for head in range(q.shape[0]):
                    p = torch.softmax((k[visible] @ q[head, i]).double() * scale, dim=0)
                    out[head, i] = p @ v[visible].double()
                    if policy.score_queries == "all" or i == stop - 1:
                        for j, p_j in zip(visible, p.tolist(), strict=True):
                            mass[j] = mass.get(j, 0.0) + p_j
            for j in new:
                score[j] = upfront[j] if upfront is not None else 0.0
            kept += new
            if policy.needs_scores and upfront is None:
                fold(policy, score, kept, mass)
            while budget is not None and len(kept) > budget.total:
                candidates = [j for j in kept if sinks <= j < stop - budget.recent]
                kept.remove(lowest(policy, score, candidates, seen=stop))
    return out, sorted(kept)


def fold(policy: Policy, score: dict, tokens: list[int], mass: dict) -> None:
    """The policy's ``accumulate`` over ``tokens`` (``h2o`` adds the mass, ``tova`` replaces)."""
    folded = torch.tensor([score[j] for j in tokens], dtype=torch.float64)
    policy.accumulate(folded, torch.tensor([mass.get(j, 0.0) for j in tokens], dtype=torch.float64))
    score.update(zip(tokens, folded.tolist(), strict=True))


def lowest(policy: Policy, score: dict, candidates: list[int], seen: int) -> int:
    """The candidate the policy ranks lowest once ``seen`` tokens have been read."""
    key = policy.eviction_key(
        torch.tensor([score[j] for j in candidates], dtype=torch.float64),
        torch.tensor(candidates), torch.tensor(seen),
    )
    return candidates[int(key.argmin())]


def call_scores(policy: Policy, q, k, kept: list[int], c0: int, c1: int, scale: float) -> dict | None:
    """Scores the policy gives the kept tokens and a whole call ``c0..c1`` before it is chunked
    (SnapKV), as ``{token: score}``; None for a policy that scores chunk by chunk."""
    ranked = policy.prefill_scores(
        q[None, :, c0:c1], k[None, None, c0:c1], k[None, None, kept],
        torch.ones(1, 1, len(kept), dtype=torch.bool), torch.tensor([c1 - c0]), scale,
    )
    if ranked is None:
        return None
    old, new = ranked
    return dict(zip(kept + list(range(c0, c1)), old[0, 0].tolist() + new[0, 0].tolist(), strict=True))


def reference(q, k, v, policy: str | Policy, heavy: int, recent: int, calls=None, chunk: int = 1, scale: float = 1.0):
    """Every KV head of one sequence: ``q`` ``[Hq, n, D]``, ``k``/``v`` ``[Hkv, n, D]``; ``calls``
    defaults to one call of all ``n`` tokens. Returns ``(out [Hq, n, Dv], kept per KV head)``."""
    hkv, n = k.shape[0], k.shape[1]
    g = q.shape[0] // hkv
    calls = calls if calls is not None else [(0, n)]
    outs, kept = [], []
    for h in range(hkv):
        out, kept_h = reference_head(q[h * g:(h + 1) * g], k[h], v[h], policy, heavy, recent, calls, chunk, scale)
        outs.append(out)
        kept.append(kept_h)
    return torch.cat(outs), kept
