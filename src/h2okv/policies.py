"""Eviction policies: which slot to free when a (sequence, layer, KV head) is over budget.

One mechanism (``SlotLayer``) serves all policies; a policy only ranks slots. The mechanism already
protects the last ``recent`` tokens and free slots, so a policy answers one question: among the
candidates, which go first? Lower key = evicted first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import H2OError


@dataclass(frozen=True)
class Budget:
    """Slots per (sequence, layer, KV head): ``heavy`` ranked by the policy plus ``recent`` kept always."""

    heavy: int
    recent: int

    @property
    def total(self) -> int:
        return self.heavy + self.recent


class Policy:
    name: str = ""
    #: whether the attention must produce per-slot probability mass (only H2O needs it; the others
    #: can use the fused SDPA kernel)
    needs_scores: bool = False
    #: ``full`` never evicts
    evicts: bool = True
    #: first tokens that are never evicted (StreamingLLM's attention sinks)
    sink_tokens: int = 0

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generator: dict[tuple[torch.device, int], torch.Generator] = {}

    def split(self, heavy: int, recent: int) -> Budget:
        """How a (heavy, recent) budget is used by this policy; the total is always kept."""
        return Budget(heavy, recent)

    def eviction_key(self, score: torch.Tensor, ordinal: torch.Tensor, layer_idx: int = 0) -> torch.Tensor:
        """Rank ``[B, H, capacity]`` slots of one layer; the lowest candidates are evicted."""
        raise NotImplementedError


class FullPolicy(Policy):
    name = "full"
    evicts = False

    def eviction_key(self, score, ordinal, layer_idx=0):  # pragma: no cover - never asked
        raise AssertionError("full never evicts")


class H2OPolicy(Policy):
    """Heavy hitters: evict the non-recent token with the least accumulated attention (Algorithm 1)."""

    name = "h2o"
    needs_scores = True

    def eviction_key(self, score, ordinal, layer_idx=0):
        return score


class LocalPolicy(Policy):
    """Sliding window of the same total budget: evict the oldest token."""

    name = "local"

    def split(self, heavy, recent):
        return Budget(0, heavy + recent)

    def eviction_key(self, score, ordinal, layer_idx=0):
        return ordinal.to(torch.float32)


class SinkPolicy(Policy):
    """StreamingLLM: the first 4 tokens (attention sinks) plus a window of the most recent."""

    name = "sink"
    sink_tokens = 4

    def split(self, heavy, recent):
        total = heavy + recent
        sinks = min(self.sink_tokens, max(total - 1, 0))
        return Budget(sinks, total - sinks)

    def eviction_key(self, score, ordinal, layer_idx=0):
        key = ordinal.to(torch.float32)
        return key.masked_fill(ordinal < self.sink_tokens, math.inf)


class RandomPolicy(Policy):
    """Random among the non-recent tokens (a control: what does *choosing* buy?). Seeded."""

    name = "random"

    def eviction_key(self, score, ordinal, layer_idx=0):
        # one stream per layer: the draws of a layer do not depend on how the forward calls
        # interleave layers (one pass over a whole text == a token-by-token loop)
        gen = self._generator.get((score.device, layer_idx))
        if gen is None:
            gen = torch.Generator(device=score.device)
            gen.manual_seed(self.seed * 1_000_003 + layer_idx)
            self._generator[(score.device, layer_idx)] = gen
        return torch.rand(score.shape, generator=gen, device=score.device)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FullPolicy, H2OPolicy, LocalPolicy, SinkPolicy, RandomPolicy)
}


def make_policy(name: str | Policy, seed: int = 0) -> Policy:
    if isinstance(name, Policy):
        return name
    try:
        return POLICIES[name](seed=seed)
    except KeyError:
        raise H2OError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
