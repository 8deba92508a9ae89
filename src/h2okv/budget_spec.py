"""A budget as the user spells it: ``BudgetSpec`` (absolute slots or fractions of each prompt) and
the rules every entry point checks a budget by, said in the caller's words (``SettingError``).

Torch-free (the settings and the command line check a budget before torch loads): a policy here
is anything with the ``Policy`` class attributes read (``evicts``, ``needs_scores``, ``name``).
``core/budget.py`` turns a spec into per-row slot tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from h2okv.recipes import DEFAULT_RECIPE_BUDGET
from h2okv.vocabulary import SettingError

if TYPE_CHECKING:
    from h2okv.policies import Policy

# the share of a budget kept for the most recent tokens: the paper's half and half
DEFAULT_RECENT_SHARE = 0.5
# The fewest slots per (layer, KV head) a *fraction* of the prompt keeps: 20% of a 37-token chat
# question is 7 slots, and the default model then answers "What is the capital of France?" with
# "The capital of the world is no...". Measured on one-fact chat questions of 36-40 tokens, 64 new
# tokens (tools/measure/budget_floor.py, docs/RESULTS.md "Budget floor"): at 64 slots 7 of 12
# answers were the full cache's word for word, at 96 and 128 all 12; 128 leaves room for
# longer answers. A slot count given as such is never raised.
DEFAULT_BUDGET_FLOOR = 128


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


def budget_of(policy, budget, recent_share, parts: dict, defaulted: bool = False) -> tuple:
    """The one rule for how a budget is spelled: ``(budget, recent_share)`` as they stand once
    checked, for ``policy`` (a ``Policy``). A ``budget`` (a fraction or slots) is split by
    ``recent_share`` (the paper's half by default) and excludes the older ``parts``
    (``heavy``/``recent``/``heavy_ratio``/``recent_ratio``); a share alone, or a recipe
    (``defaulted``) with neither, keeps the default fifth; a share beside parts has nothing to
    split; a policy that keeps every token takes no budget. The parts' own ranges are
    ``BudgetSpec.build``'s."""
    given_parts = [name for name, value in parts.items() if value is not None]
    if budget is not None or ((defaulted or recent_share is not None) and policy.evicts and not given_parts):
        if given_parts:
            raise two_spellings(given_parts)
        if not policy.evicts:
            raise takes_no_budget(policy, ["budget"])
        share = DEFAULT_RECENT_SHARE if recent_share is None else recent_share
        budget = DEFAULT_RECIPE_BUDGET if budget is None else budget
        budget_keywords(budget, share, policy)  # the budget's range for this policy
        return budget, share
    if recent_share is not None and policy.evicts:
        raise share_without_budget()
    return None, None  # the budget is in parts (or the paper's default): no share split it
