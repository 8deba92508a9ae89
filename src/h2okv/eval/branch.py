"""Multiple-choice scoring that reads each shared context once, then branches per continuation.

The choices of a multiple-choice item share their context (the few-shot prompt and the question),
and with eviction the cache state after the context does not depend on the choice. So:

1. the distinct contexts of a batch are read in one forward call through one cache (left-padded;
   per-token eviction for evicting policies), keeping only the last position's logits, which
   score every continuation's first token;
2. the cache's rows are repeated, one per continuation (``H2OCache.batch_select_indices``), and
   all continuations go through a second forward call together (right-padded; the cache moves
   each row's real tokens first), scoring their remaining tokens.

The result equals scoring each (context, continuation) alone with the same cache budget
(``tests/eval/test_branch.py``), at the cost of reading each context once instead of once per
choice. The budget of a ratio cache is resolved at the first forward call, so it is a fraction
of the *context* length (the continuation then evicts one token per token, as in decoding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from h2okv.core.compat import cache_arg
from h2okv.generation import pad_rows


def branch_loglikelihoods(model, rows: list[tuple[list[int], list[int]]], cache, pad_id: int) -> list[tuple[float, bool]]:
    """``(log-likelihood, is_greedy)`` of each ``(context, continuation)`` in ``rows``, contexts
    read once through ``cache`` (a fresh cache: it holds the batch afterwards). Contexts and
    continuations must be non-empty."""
    contexts: dict[tuple[int, ...], int] = {}
    group = [contexts.setdefault(tuple(ctx), len(contexts)) for ctx, _ in rows]
    device = model.device
    ids, mask = pad_rows([list(c) for c in contexts], pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        last = model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_arg(cache),
                     use_cache=True, logits_to_keep=1).logits[:, -1].float()
        first_lp = F.log_softmax(last, dim=-1)  # [contexts, V]: predicts each continuation's first token

        totals = [float(first_lp[g, cont[0]]) for g, (_, cont) in zip(group, rows, strict=True)]
        greedy = [bool(first_lp[g].argmax() == cont[0]) for g, (_, cont) in zip(group, rows, strict=True)]
        longer = [i for i, (_, cont) in enumerate(rows) if len(cont) > 1]
        if not longer:
            return list(zip(totals, greedy, strict=True))

        # one cache row per continuation that has more than one token
        cache.batch_select_indices(torch.tensor([group[i] for i in longer], dtype=torch.long))
        past_mask = mask[[group[i] for i in longer]]
        inputs = [rows[i][1][:-1] for i in longer]
        new_ids, new_mask = pad_rows(inputs, pad_id, device, side="right")
        start = past_mask.sum(-1, keepdim=True)  # real context tokens of each row
        new_pos = start + torch.arange(new_ids.shape[1], device=device)[None, :]
        logits = model(input_ids=new_ids, attention_mask=torch.cat([past_mask, new_mask], dim=-1),
                       position_ids=new_pos, **cache_arg(cache), use_cache=True).logits
        for row, i in enumerate(longer):
            cont = rows[i][1]
            lp = F.log_softmax(logits[row, : len(cont) - 1].float(), dim=-1)  # predicts cont[1:]
            target = torch.tensor(cont[1:], dtype=torch.long, device=lp.device)
            totals[i] += float(lp.gather(-1, target[:, None]).sum())
            greedy[i] = greedy[i] and bool((lp.argmax(-1) == target).all())
    return list(zip(totals, greedy, strict=True))
