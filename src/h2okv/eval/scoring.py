"""Teacher-forced scoring with eviction applied while the text is read: the cache for it, per-token
negative log-likelihood, perplexity. Shared by ``eval ppl``, the task evaluations and the bench."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from h2okv.core.cache import DEFAULT_CHUNK, H2OCache
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.generation import new_cache
from h2okv.policies import policy_class


def make_cache(model, policy: str, budget: float | None, seed: int = 0, **coding) -> H2OCache:
    """The cache for one streaming pass: per-token eviction for evicting policies; ``coding``:
    ``kv_bits`` / ``kv_group`` of quantized slots."""
    evicts = policy_class(policy).evicts
    if evicts and budget is None:
        raise H2OError(f"policy {policy!r} needs a budget")
    # full keeps everything, so chunking cannot change what any query sees
    return new_cache(model, policy, budget, chunk_size=1 if evicts else DEFAULT_CHUNK, seed=seed, **coding)


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[B, N-1]`` negative log-likelihood of each next token (row by row to bound memory)."""
    rows = [F.cross_entropy(logits[b, :-1].float(), ids[b, 1:], reduction="none") for b in range(ids.shape[0])]
    return torch.stack(rows)


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


def streaming_nll(model, ids: torch.Tensor, policy: str, budget: float | None, seed: int = 0, **coding):
    """``(nll [B, N-1], slots)``: one teacher-forced pass with eviction applied as the text is read.

    ``slots`` is the number of tokens each (layer, head) keeps (``None`` for ``full``).
    """
    cache = make_cache(model, policy, budget, seed, **coding)
    with torch.inference_mode():
        logits = model(ids.to(model.device), **cache_arg(cache), use_cache=True).logits
    budgets = cache.budget()
    return token_nll(logits, ids.to(logits.device)).cpu(), (budgets[0] if budgets else None)
