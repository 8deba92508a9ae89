"""The server's eviction settings (``--policy``, ``--heavy``...) and how one request's override
resolves against them into absolute slots (what a ``GenerationRequest`` carries)."""

from __future__ import annotations

from dataclasses import dataclass

from h2okv.core import BudgetSpec
from h2okv.core.cache import PREFILL_MODES
from h2okv.errors import H2OError
from h2okv.policies import make_policy

BUDGET_FIELDS = ("heavy", "recent", "heavy_ratio", "recent_ratio")


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

    def describe(self) -> dict:
        return {"policy": self.policy, **self.budget()}

    def budget(self) -> dict:
        return {"heavy": self.heavy, "recent": self.recent, "heavy_ratio": self.heavy_ratio,
                "recent_ratio": self.recent_ratio}

    def validate(self) -> None:
        BudgetSpec.build(make_policy(self.policy), **self.budget())
        if self.prefill not in PREFILL_MODES:
            raise H2OError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")

    def resolve(self, prompt_len: int, policy: str | None = None,
                budget: dict | None = None) -> tuple[str, int | None, int | None]:
        """(policy, heavy, recent) slots for one request; raises ``H2OError`` for bad settings.

        ``policy``: the request's policy (None: the server's); ``budget``: the request's budget
        fields (``BUDGET_FIELDS``), which replace the server's whole budget (None: none given)."""
        chosen = make_policy(policy if policy is not None else self.policy)
        if budget is not None:
            fields = {name: budget.get(name) for name in BUDGET_FIELDS}
        elif chosen.evicts and make_policy(self.policy).evicts:
            fields = self.budget()
        else:  # switching to/from "full": the server's budget does not carry over
            fields = dict.fromkeys(BUDGET_FIELDS)
        spec = BudgetSpec.build(chosen, **fields)
        if not chosen.evicts:
            return chosen.spec, None, None
        heavy, recent = spec.resolve(prompt_len)
        return chosen.spec, heavy, recent  # the spec: options such as snapkv's window reach the cache
