"""Budgets: what the user asked for (``BudgetSpec``) and how it becomes per-row slot counts
(``RowBudgets``, shared by a cache's layers)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from h2okv.policies import Budget, Policy, policy_class
from h2okv.settings import DEFAULT_BUDGET_FLOOR, DEFAULT_RECENT_SHARE
from h2okv.vocabulary import SettingError

# a budget below this many slots per (layer, KV head) warns once: it rarely keeps an answer
DEGENERATE_SLOTS = 16


class H2OBudgetWarning(UserWarning):
    """A budget so small that answers degrade (fewer than ``DEGENERATE_SLOTS`` slots)."""


@dataclass(frozen=True)
class BudgetSpec:
    """Either absolute slot counts or fractions of each sequence's prompt length (paper's setting)."""

    heavy: int | None = None
    recent: int | None = None
    heavy_ratio: float | None = None
    recent_ratio: float | None = None
    #: the fewest slots a ratio budget keeps (``DEFAULT_BUDGET_FLOOR``; 0: none)
    floor: int = 0

    @classmethod
    def build(cls, policy: Policy, heavy=None, recent=None, heavy_ratio=None, recent_ratio=None,
              floor: int = DEFAULT_BUDGET_FLOOR) -> BudgetSpec:
        given = {"heavy": heavy, "recent": recent, "heavy_ratio": heavy_ratio, "recent_ratio": recent_ratio}
        absolute = heavy is not None or recent is not None
        ratio = heavy_ratio is not None or recent_ratio is not None
        if not policy.evicts:
            if absolute or ratio:
                raise takes_no_budget(policy, [name for name, value in given.items() if value is not None])
            return cls()
        if absolute and ratio:
            raise SettingError("give either {heavy}/{recent} or {heavy_ratio}/{recent_ratio}, not both")
        if not absolute and not ratio:
            # the paper's setting: 10% heavy hitters + 10% recent of the prompt ("20% KV cache")
            heavy_ratio, recent_ratio = 0.1, 0.1
        elif absolute:
            heavy, recent = int(heavy or 0), int(recent or 0)
            if heavy < 0 or recent < 0 or heavy + recent <= 0:
                raise SettingError("{heavy} and {recent} must be slot counts >= 0 with a positive sum, got {h} and {r}",
                                   h=heavy, r=recent)
            if policy.needs_scores and (heavy <= 0 or recent <= 0):
                raise SettingError("{name} ranks heavy hitters and keeps recent tokens: it needs at least 1 slot "
                                   "in each of {heavy} and {recent}, got {h} and {r}", name=policy.name, h=heavy,
                                   r=recent)
            return cls(heavy=heavy, recent=recent)
        heavy_ratio = float(heavy_ratio or 0.0)
        recent_ratio = float(recent_ratio or 0.0)
        for name, value in (("heavy_ratio", heavy_ratio), ("recent_ratio", recent_ratio)):
            if not (0.0 <= value <= 1.0) or math.isnan(value):
                raise SettingError(f"{{{name}}} must be a fraction of the prompt in (0, 1] (or 0: no such part), "
                                   f"got {{got}}", got=value)
        if heavy_ratio + recent_ratio <= 0:
            raise SettingError("{heavy_ratio} + {recent_ratio} must be > 0")
        if policy.needs_scores and (heavy_ratio <= 0 or recent_ratio <= 0):
            raise SettingError("{name} ranks heavy hitters and keeps recent tokens: it needs {heavy_ratio} and "
                               "{recent_ratio} both in (0, 1], got {h} and {r}", name=policy.name, h=heavy_ratio,
                               r=recent_ratio)
        return cls(heavy_ratio=heavy_ratio, recent_ratio=recent_ratio, floor=check_floor(floor))

    @classmethod
    def from_fraction(cls, fraction: float, recent_share: float = DEFAULT_RECENT_SHARE) -> BudgetSpec:
        """Keep ``fraction`` of each prompt, ``recent_share`` of it for the most recent tokens and
        the rest for the policy's choice. The default (0.5) is the paper's setting, where a "20%
        KV cache" (0.2) is 10% heavy + 10% recent; a small share (0.05: 1% recent at 20%) spends
        almost every slot on the policy's ranking, as kvpress's presses do."""
        share = check_recent_share(recent_share)
        return cls(heavy_ratio=fraction * (1 - share), recent_ratio=fraction * share)

    @classmethod
    def from_slots(cls, slots: int, recent_share: float = DEFAULT_RECENT_SHARE) -> BudgetSpec:
        """Keep ``slots`` tokens per (layer, KV head) whatever the prompt's length, split like
        ``from_fraction``: ``recent_share`` of them recent (by default half; the odd slot is
        recent), the rest heavy hitters."""
        heavy = int(int(slots) * (1 - check_recent_share(recent_share)))
        return cls(heavy=heavy, recent=int(slots) - heavy)

    @property
    def is_ratio(self) -> bool:
        return self.heavy_ratio is not None

    def resolve(self, prompt_len: int) -> tuple[int, int]:
        """(heavy, recent) slots for a sequence whose prompt has ``prompt_len`` real tokens."""
        if not self.is_ratio:
            return self.heavy, self.recent
        total = self.heavy_ratio + self.recent_ratio
        if prompt_len * total < self.floor:
            # a short prompt's fraction is raised to the floor, split in the ratios' proportions
            heavy = round(self.floor * self.heavy_ratio / total)
            if self.heavy_ratio > 0 and self.recent_ratio > 0:
                heavy = min(max(heavy, 1), self.floor - 1)
            return heavy, self.floor - heavy
        # at least one slot for each part whose ratio is > 0 (a 5-token prompt still gets a budget)
        heavy = max(1, int(self.heavy_ratio * prompt_len)) if self.heavy_ratio > 0 else 0
        recent = max(1, int(self.recent_ratio * prompt_len)) if self.recent_ratio > 0 else 0
        return heavy, recent


def check_floor(floor) -> int:
    """``floor`` as a slot count >= 0, else a one-line error."""
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
        raise SettingError("{budget_floor} must be a whole number of slots >= 0, got {got}", got=repr(floor))
    return floor


# what a budget may be, in every message about one (``least``: ``least_slots``)
BUDGET_RULE = "a fraction of the prompt in (0, 1] (e.g. 0.2) or a whole number of slots >= {least}{policy} (e.g. 256)"


def least_slots(policy: Policy | type[Policy], recent_share: float = DEFAULT_RECENT_SHARE) -> int:
    """The fewest slots a budget given as a count may have under ``policy`` once ``recent_share``
    splits it (``from_slots``): 1, or, for a policy that ranks by scores (``needs_scores``: h2o
    needs a heavy and a recent slot), the least count whose heavy part is >= 1 (2 at the default
    half and half); a share that leaves such a policy no heavy or no recent part is an error."""
    share = check_recent_share(recent_share)
    if not policy.needs_scores:
        return 1
    if not 0.0 < share < 1.0:
        raise SettingError("{recent_share} {got} leaves {name} no {part} slots: it ranks heavy hitters and keeps "
                           "recent tokens, so give a share in (0, 1)", got=share, name=policy.name,
                           part="recent" if share == 0 else "heavy")
    slots = max(2, math.ceil(1 / (1 - share)))
    while BudgetSpec.from_slots(slots, share).heavy < 1:  # float rounding: a step or two at most
        slots += 1
    return slots


def budget_keywords(budget, recent_share: float = DEFAULT_RECENT_SHARE, policy: Policy | None = None) -> dict:
    """``H2OCache``'s one ``budget`` argument as the heavy/recent keywords it stands for: a float
    in (0, 1] is a fraction of each prompt, an int (or a whole float above 1) slots per (layer, KV
    head), at least ``least_slots`` for ``policy``; ``recent_share`` of it is kept for the most
    recent tokens."""
    least = 1 if policy is None else least_slots(policy, recent_share)
    number = not isinstance(budget, bool) and isinstance(budget, (int, float)) and not math.isnan(budget)
    fraction = number and isinstance(budget, float) and (budget <= 1 or not budget.is_integer())
    if fraction and 0.0 < budget <= 1.0:
        spec = BudgetSpec.from_fraction(budget, recent_share)
        return {"heavy_ratio": spec.heavy_ratio, "recent_ratio": spec.recent_ratio}
    if number and not fraction and least <= budget < math.inf:
        spec = BudgetSpec.from_slots(int(budget), recent_share)
        return {"heavy": spec.heavy, "recent": spec.recent}
    raise SettingError("{budget} must be " + BUDGET_RULE + ", got {got}", least=least,
                       policy="" if policy is None else f" for {policy.name}", got=budget if number else repr(budget))


def takes_no_budget(policy: Policy, names) -> SettingError:
    """The error for a budget (``names``: the settings given) on a policy that keeps every token."""
    return SettingError(f"policy {{name!r}} keeps every token; do not give it {' or '.join('{' + n + '}' for n in names)}",
                        name=policy.name)


def two_spellings(parts) -> SettingError:
    """The error for ``budget`` given beside the older parts (``parts``: those given)."""
    return SettingError(f"give either {{budget}} or {'/'.join('{' + p + '}' for p in parts)}, not both")


def share_without_budget() -> SettingError:
    """The error for a recent share beside a budget given in parts (it splits ``budget`` only)."""
    return SettingError("{recent_share} splits {budget}; with {heavy}/{recent} or {heavy_ratio}/{recent_ratio} "
                        "give both parts yourself")


def check_recent_share(share: float) -> float:
    """``share`` as a float in [0, 1], else a one-line error."""
    try:
        value = float(share)
    except (TypeError, ValueError):
        value = math.nan
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise SettingError("{recent_share} must be a number in [0, 1], got {got}", got=repr(share))
    return value


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
        return twin

    def extend(self, other: RowBudgets) -> None:
        """Append ``other``'s rows (their budgets fixed)."""
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
