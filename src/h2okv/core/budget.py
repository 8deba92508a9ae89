"""Budgets in a running cache: how what the user asked for (``BudgetSpec``, ``h2okv.budget_spec``)
becomes per-row slot counts (``RowBudgets``, shared by a cache's layers)."""

from __future__ import annotations

import math
import warnings

import torch

# the budget as the user spells it, torch-free (h2okv.budget_spec); here: per-row slots, in tensors
from h2okv.budget_spec import (  # noqa: F401 (re-exported: the budget's public names stay importable from here)
    BUDGET_RULE,
    DEFAULT_BUDGET_FLOOR,
    DEFAULT_RECENT_SHARE,
    BudgetSpec,
    budget_keywords,
    check_floor,
    check_recent_share,
    least_slots,
    share_without_budget,
    takes_no_budget,
    two_spellings,
)
from h2okv.core.words import WordRecord
from h2okv.policies import Budget, Policy, policy_class

# a budget below this many slots per (layer, KV head) warns once: it rarely keeps an answer
DEGENERATE_SLOTS = 16


class H2OBudgetWarning(UserWarning):
    """A budget so small that answers degrade (fewer than ``DEGENERATE_SLOTS`` slots)."""


def fraction_keywords(policy: str, fraction: float | None, recent_share: float = DEFAULT_RECENT_SHARE) -> dict:
    """The ``H2OCache`` budget keywords for keeping ``fraction`` of each prompt (``from_fraction``,
    ``recent_share`` of it recent); none for a policy that keeps every token (it takes no budget)."""
    if not policy_class(policy).evicts:
        return {}
    least_slots(policy_class(policy), recent_share)  # a share that leaves h2o no heavy or recent part
    spec = BudgetSpec.from_fraction(fraction, recent_share)
    return {"heavy_ratio": spec.heavy_ratio, "recent_ratio": spec.recent_ratio}


def slots_keywords(policy: str, slots: int | None, recent_share: float = DEFAULT_RECENT_SHARE) -> dict:
    """The ``H2OCache`` budget keywords for keeping ``slots`` tokens per (layer, KV head)
    (``from_slots``, ``recent_share`` of them recent); none for a policy that keeps every token."""
    if not policy_class(policy).evicts:
        return {}
    least_slots(policy_class(policy), recent_share)
    spec = BudgetSpec.from_slots(slots, recent_share)
    return {"heavy": spec.heavy, "recent": spec.recent}


class RowBudgets:
    """Each row's ``(heavy, recent)`` slots, fixed by its first forward call (its prompt) and shared
    by every layer of a cache: the one cache-wide input a layer reads when a call starts.

    ``heavy`` and ``recent`` are ``[B]`` CPU tensors (None before the first call). It holds no
    reference to the cache or its layers, so the layers that share it form no cycle with it."""

    def __init__(self, policy: Policy, spec: BudgetSpec, protect_prompt: bool = False):
        self.policy, self.spec = policy, spec
        # the first call's tokens (the prompt) kept whole, the budget on top for what follows
        self.protect_prompt = protect_prompt
        self.heavy: torch.Tensor | None = None
        self.recent: torch.Tensor | None = None
        self.sinks: torch.Tensor | None = None  # protected first tokens per row
        # each row's token ids by ordinal, for a policy that pools by words (core/words.py)
        self.words: WordRecord | None = WordRecord() if policy.words else None
        # a context held whole, its budget set and nothing ranked yet (core/held.py): only a call of
        # two tokens or more (the question) ranks what is held and brings it down to the budget
        self.awaiting_question = False

    @property
    def rows(self) -> int:
        return 0 if self.heavy is None else int(self.heavy.shape[0])

    @property
    def fixed(self) -> bool:
        return self.heavy is not None

    def split(self, heavy_recent: tuple[int, int]) -> Budget:
        """The policy's use of a ``(heavy, recent)`` pair (a policy that keeps everything: none)."""
        return self.policy.split(*heavy_recent) if self.policy.evicts else Budget(0, 0)

    def fix(self, pairs: list[tuple[int, int]], prompts: list[int] | None = None) -> None:
        """Set the rows' budgets from absolute ``(heavy, recent)`` pairs, split by the policy. With
        ``prompts`` (each row's prompt length), each prompt is kept whole on top of its budget: its
        tokens are protected like sinks and added to the heavy part, so the rule never evicts one
        and a row at its budget still always has a candidate (``sinks <= heavy``)."""
        budgets = [self.split(pair) for pair in pairs]
        self.heavy = torch.tensor([b.heavy for b in budgets], dtype=torch.long)
        self.recent = torch.tensor([b.recent for b in budgets], dtype=torch.long)
        # sinks never exceed the heavy part, so a row at its budget always has a candidate
        self.sinks = self.heavy.clamp(max=self.policy.sink_tokens)
        if prompts is not None and self.policy.evicts:
            prompt = torch.tensor(prompts, dtype=torch.long)
            self.heavy = self.heavy + prompt
            self.sinks = torch.maximum(self.sinks, prompt)

    def for_call(self, nonpad: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(heavy, recent, sinks)`` per row on ``device``; the first call (``nonpad`` ``[B, n]``: its
        real tokens) fixes them from the spec and the prompt's lengths."""
        if self.heavy is None:
            lengths = nonpad.sum(-1).tolist()
            self.fix([self.spec.resolve(n) for n in lengths], lengths if self.protect_prompt else None)
            self._warn_if_degenerate()
        return self.heavy.to(device), self.recent.to(device), self.sinks.to(device)

    def _warn_if_degenerate(self) -> None:
        if not self.rows:
            return
        # a protected prompt is kept on top of the budget: what is left to rank is the rest
        kept = self.heavy + self.recent - (self.sinks if self.protect_prompt else 0)
        smallest = int(kept.min())
        if self.policy.evicts and 0 < smallest < DEGENERATE_SLOTS:
            warnings.warn(f"h2okv: a budget of {smallest} slots per layer and KV head rarely keeps an answer; "
                          f"give budget= a larger fraction or at least {DEGENERATE_SLOTS} slots "
                          f"(budget_floor raises fractions of short prompts)", H2OBudgetWarning, stacklevel=2)

    def select(self, index: torch.Tensor) -> RowBudgets:
        """A new ``RowBudgets`` holding rows ``index`` (repeats allowed)."""
        twin = RowBudgets(self.policy, self.spec, self.protect_prompt)
        if self.heavy is not None:
            index = index.cpu()
            twin.heavy, twin.recent, twin.sinks = (t.index_select(0, index) for t in (self.heavy, self.recent, self.sinks))
        if self.words is not None:
            twin.words = self.words.select(index)
        twin.awaiting_question = self.awaiting_question
        return twin

    def extend(self, other: RowBudgets) -> None:
        """Append ``other``'s rows (their budgets fixed)."""
        if self.words is not None:
            self.words.extend(self.rows, other.words, other.rows)
        self.heavy, self.recent, self.sinks = (torch.cat([mine, theirs]) for mine, theirs in
                                               ((self.heavy, other.heavy), (self.recent, other.recent),
                                                (self.sinks, other.sinks)))

    def totals(self) -> list[int] | None:
        """Slots per (layer, head) of each row, or None (keeps every token, or no call yet)."""
        if self.heavy is None or not self.policy.evicts:
            return None
        return (self.heavy + self.recent).tolist()

    @property
    def max_budget(self) -> int | float:
        if self.heavy is None or not self.policy.evicts:
            return math.inf
        return int((self.heavy + self.recent).max())
