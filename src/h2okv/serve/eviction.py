"""The server's eviction settings (``--recipe``, ``--policy``, ``--budget``...) and how one
request's override resolves against them into absolute slots (what a ``GenerationRequest``
carries)."""

from __future__ import annotations

from dataclasses import dataclass

from h2okv.core.budget import BudgetSpec, budget_keywords
from h2okv.policies import make_policy
from h2okv.recipes import expand
from h2okv.settings import DEFAULT_BUDGET_FLOOR, CacheSettings, budget_of
from h2okv.settings import PART_NAMES as PART_FIELDS  # the older spelling of a budget

# the older spelling and the one-argument spelling (budget + its recent share)
BUDGET_FIELDS = (*PART_FIELDS, "budget", "recent_share")


@dataclass(frozen=True)
class EvictionDefaults:
    """The server's eviction settings, which a request may override."""

    policy: str = "h2o"
    heavy: int | None = None
    recent: int | None = None
    heavy_ratio: float | None = None
    recent_ratio: float | None = None
    #: H2OCache's prefill mode for every request (``serve --prefill``): ``late`` feeds a prompt in
    #: one forward call and ranks it once at its end (peak: the prompt), ``chunked`` is bounded
    prefill: str = "chunked"
    #: the recipe the settings were expanded from (``from_options``), shown by ``/v1/models``
    recipe: str | None = None
    #: a fraction of each prompt or slots (``H2OCache``'s ``budget``), ``recent_share`` of it recent
    budget: float | int | None = None
    recent_share: float | None = None
    #: the fewest slots a fractional budget keeps (a short chat prompt must not get 3 + 3 slots)
    budget_floor: int = DEFAULT_BUDGET_FLOOR
    #: how the recipe shares slots among heads (``H2OCache``'s ``head_budgets``/``head_floor``),
    #: for requests of the server's own policy: the ``document`` recipe's cache-wide split
    head_budgets: str = "uniform"
    head_floor: float | None = None

    @classmethod
    def from_options(cls, recipe: str | None = None, policy: str | None = None, prefill: str | None = None,
                     budget_floor: int | None = None, **budget) -> EvictionDefaults:
        """The server's settings from its flags: ``recipe`` fills what is not given, and the whole
        is checked as a cache's settings are (``CacheSettings``: one set of rules and messages)."""
        settings = CacheSettings.build(policy, recipe=recipe, prefill=_reading(policy, prefill),
                                       budget_floor=budget_floor, **budget)
        # the recipe's head split goes with the recipe's own policy (CacheSettings.build keeps it so)
        split = settings.head_budgets != "uniform"
        return cls(policy=settings.policy_spec, prefill=_reading(None, settings.prefill), recipe=recipe,
                   budget=settings.budget, recent_share=settings.recent_share, budget_floor=settings.budget_floor,
                   head_budgets=settings.head_budgets, head_floor=settings.head_floor if split else None,
                   **{name: getattr(settings, name) for name in PART_FIELDS})

    def settings(self) -> CacheSettings:
        """The server's own policy's cache settings, checked (``CacheSettings``)."""
        split = {} if self.head_floor is None else {"head_floor": self.head_floor}
        return CacheSettings.build(self.policy, prefill=_reading(self.policy, self.prefill), recipe=self.recipe,
                                   budget_floor=self.budget_floor, head_budgets=self.head_budgets, **split,
                                   **self.budget_fields())

    def describe(self) -> dict:
        extra = {name: value for name, value in (("recipe", self.recipe), ("budget", self.budget),
                                                 ("recent_share", self.recent_share)) if value is not None}
        split = {"head_budgets": self.head_budgets, "head_floor": self.head_floor} if self.cache_options() else {}
        return {"policy": self.policy, **extra, **{name: getattr(self, name) for name in PART_FIELDS},
                "budget_floor": self.budget_floor, **split}

    def cache_options(self) -> dict[str, dict]:
        """``H2OCache`` keywords beyond the budget, by policy spec: the executor builds every cache
        of the server's policy with them (plain data, so ``--tp`` followers get the same)."""
        if self.head_budgets == "uniform" and self.head_floor is None:
            return {}
        split = {"head_budgets": self.head_budgets}
        if self.head_floor is not None:
            split["head_floor"] = self.head_floor
        return {make_policy(self.policy).spec: split}  # the spec requests of this policy carry

    def budget_fields(self) -> dict:
        return {name: getattr(self, name) for name in BUDGET_FIELDS}

    def validate(self) -> None:
        self.settings()

    def resolve(self, prompt_len: int, policy: str | None = None, budget: dict | None = None,
                recipe: str | None = None) -> tuple[str, int | None, int | None]:
        """(policy, heavy, recent) slots for one request; raises ``H2OError`` for bad settings.

        ``policy``: the request's policy (None: its recipe's, else the server's); ``budget``: the
        request's budget fields (``BUDGET_FIELDS``), which replace the server's whole budget (None:
        none given); ``recipe``: the request's recipe, whose policy and recent share apply (the
        prefill mode stays the server's)."""
        settings = expand(recipe, policy=policy)  # the request's recipe, its policy over the recipe's
        chosen = make_policy(settings.get("policy") or self.policy)
        if budget is not None:
            fields = {name: budget.get(name) for name in BUDGET_FIELDS}
        elif chosen.evicts and make_policy(self.policy).evicts:
            fields = self.budget_fields()
            if recipe and fields["budget"] is not None:  # the request's recipe splits the server's budget its way
                fields["recent_share"] = None
        else:  # switching to/from "full": the server's budget does not carry over
            fields = dict.fromkeys(BUDGET_FIELDS)
        parts = {name: fields[name] for name in PART_FIELDS}
        share = fields["recent_share"]
        if share is None and not any(value is not None for value in parts.values()):
            share = settings.get("recent_share")  # a request's recipe splits the budget its way
        budget, share = budget_of(chosen, fields["budget"], share, parts, defaulted=recipe is not None)
        if budget is not None:
            parts = budget_keywords(budget, share, chosen)
        spec = BudgetSpec.build(chosen, floor=self.budget_floor, **parts)
        if not chosen.evicts:
            return chosen.spec, None, None
        heavy, recent = spec.resolve(prompt_len)
        return chosen.spec, heavy, recent  # the spec: options such as snapkv's window reach the cache


def _reading(policy: str | None, prefill: str | None) -> str | None:
    """The prefill mode a server's policy runs with: a policy ranked by reconstruction (``kvzip``)
    reads every prompt in one call, whatever ``--prefill`` says for the others (the executor opens
    such a sequence late). A streamed prefill (``bounded``) is read chunked: the engine schedules a
    prompt's chunks across its steps itself, and a request may run another policy."""
    if policy is not None and make_policy(policy).ranks_by_reconstruction:
        return "late"
    return "chunked" if prefill == "streamed" else prefill
