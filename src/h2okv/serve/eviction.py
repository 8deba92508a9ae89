"""The server's eviction settings (``--recipe``, ``--policy``, ``--budget``...) as one
``CacheSettings``, and how one request's override becomes the ``CacheSettings`` it runs with,
whose ``resolve`` gives the absolute slots a ``GenerationRequest`` carries. The budget rules are
``CacheSettings``' (``h2okv.settings``, ``h2okv.budget_spec``); this module only says which
settings a request inherits from the server's."""

from __future__ import annotations

from dataclasses import dataclass, field

from h2okv.policies import make_policy
from h2okv.recipes import expand
from h2okv.settings import DEFAULT_HEAD_FLOOR, PART_NAMES, CacheSettings, slot_coding_keywords
from h2okv.vocabulary import SettingError

# a request's budget fields: the older spelling (parts) and the one-argument spelling (budget + its recent share)
BUDGET_FIELDS = (*PART_NAMES, "budget", "recent_share")
# ``cache_options``' key of what every sequence's cache is built with, whatever its policy
EVERY_POLICY = "*"


@dataclass(frozen=True)
class EvictionDefaults:
    """The server's eviction settings, which a request may override: ``settings`` is the one
    checked value the server's own policy runs with (``from_options`` builds it from the flags)."""

    settings: CacheSettings = field(default_factory=CacheSettings)

    def __post_init__(self):
        # the server's reading of the value: a streamed prefill is read chunked (``_reading``)
        reading = _reading(self.settings.policy_spec, self.settings.prefill)
        if reading != self.settings.prefill:
            object.__setattr__(self, "settings", self.settings.replace(prefill=reading))

    @classmethod
    def from_options(cls, recipe: str | None = None, policy: str | None = None, prefill: str | None = None,
                     budget_floor: int | None = None, kv_bits: int | None = None, kv_group: int | None = None,
                     key_bits: int | None = None, float_window: int | None = None, center_keys: bool | None = None,
                     **budget) -> EvictionDefaults:
        """The server's settings from its flags: ``recipe`` fills what is not given, and the whole
        is checked here, once, as a cache's settings are (``CacheSettings``: one set of rules and
        messages). ``budget``: ``budget``/``recent_share`` or the parts (``heavy``, ...);
        ``kv_bits``: every request's slots quantized, whatever its policy."""
        return cls(CacheSettings.build(policy, recipe=recipe, prefill=_reading(policy, prefill),
                                       budget_floor=budget_floor, kv_bits=kv_bits, kv_group=kv_group,
                                       key_bits=key_bits, float_window=float_window, center_keys=center_keys,
                                       **budget))

    def for_model(self, config) -> EvictionDefaults:
        """The settings with a budget in bytes (``--bytes``, ``--budget 4MiB``) turned into this
        model's slots (``CacheSettings.for_model``); a request that gives its own budget gives it in
        slots or a fraction of its prompt."""
        return EvictionDefaults(self.settings.for_model(config))

    @property
    def policy(self) -> str:
        """The server's policy spec (requests that name no policy or recipe run it)."""
        return self.settings.policy_spec

    @property
    def prefill(self) -> str:
        """Every request's prefill mode (``Engine(prefill=)``): ``late`` feeds a prompt in one
        forward call and ranks it once at its end (peak: the prompt), ``chunked`` is bounded."""
        return self.settings.prefill

    def describe(self) -> dict:
        """The settings as plain data (``/v1/models``, the startup line, measurement rows)."""
        s = self.settings
        extra = {name: value for name, value in (("recipe", s.recipe), ("budget", s.budget),
                                                 ("recent_share", s.recent_share)) if value is not None}
        split = {"head_budgets": s.head_budgets, "head_floor": s.head_floor} if s.head_budgets != "uniform" else {}
        coding = coding_of(s) if s.kv_bits is not None else {}
        return {"policy": s.policy_spec, **extra, **{name: getattr(s, name) for name in PART_NAMES},
                "budget_floor": s.budget_floor, **split, **coding}

    def cache_options(self) -> dict[str, dict]:
        """``H2OCache`` keywords beyond the budget, by policy spec: the executor builds every cache
        of the server's policy with them (plain data, so ``--tp`` followers get the same). A
        recipe's head split goes with the server's own policy only."""
        s = self.settings
        options = {}
        if s.kv_bits is not None:  # every request's cache, full's too, and the bytes a slot is admitted by
            options[EVERY_POLICY] = coding_of(s)
        if s.head_budgets != "uniform":
            options[s.policy_spec] = {"head_budgets": s.head_budgets, "head_floor": s.head_floor}
        return options

    def request(self, policy: str | None = None, budget: dict | None = None,
                recipe: str | None = None) -> CacheSettings:
        """The settings one request runs with; raises ``H2OError`` (a ``SettingError`` for a
        budget) for bad ones.

        ``policy``: the request's policy (None: its recipe's, else the server's); ``budget``: the
        request's budget fields (``BUDGET_FIELDS``), which replace the server's whole budget (None:
        none given, and the server's carries over unless the request switches to or from a policy
        that keeps every token); ``recipe``: the request's recipe, whose policy and recent share
        apply (the server's budget split its way). The prefill mode and the budget floor stay the
        server's; the server's head split reaches only requests of its own policy spec (as
        ``cache_options`` does), and positions are the engine's (``EngineOptions.positions``)."""
        server = self.settings
        chosen = make_policy(expand(recipe, policy=policy).get("policy") or server.policy_spec)
        if budget is not None:
            fields = {name: budget.get(name) for name in BUDGET_FIELDS}
        elif chosen.evicts and make_policy(server.policy_spec).evicts:
            fields = {name: getattr(server, name) for name in BUDGET_FIELDS}
            if recipe and fields["budget"] is not None:  # the request's recipe splits the server's budget its way
                fields["recent_share"] = None
        else:  # switching to/from "full": the server's budget does not carry over
            fields = {}
        own = chosen.spec == server.policy_spec
        split = {"head_budgets": server.head_budgets if own else "uniform",
                 "head_floor": server.head_floor if own else DEFAULT_HEAD_FLOOR}
        settings = CacheSettings.build(chosen.spec, recipe=recipe, prefill=_reading(chosen.spec, server.prefill),
                                       positions="true", budget_floor=server.budget_floor, **split, **fields)
        if settings.bytes is not None:  # bytes become slots by the model's shape, which the server fixed at start
            raise SettingError("{budget} in bytes is the server's to set (serve --bytes 0.1, --budget 4MiB); a request "
                               "gives slots or a fraction of its prompt")
        return settings

    def resolve(self, prompt_len: int, policy: str | None = None, budget: dict | None = None,
                recipe: str | None = None) -> tuple[str, int | None, int | None]:
        """(policy spec, heavy, recent) slots for one request of ``prompt_len`` prompt tokens: its
        settings (``request``; the server's own when it overrides nothing) resolved by
        ``CacheSettings.resolve``. The spec: options such as snapkv's window reach the cache."""
        overrides = policy is not None or budget is not None or recipe is not None
        settings = self.request(policy, budget, recipe) if overrides else self.settings
        heavy, recent = settings.resolve(prompt_len)
        return settings.policy_spec, heavy, recent


def coding_of(settings: CacheSettings) -> dict:
    """The quantized slots' keywords of ``settings`` (every request's cache takes them)."""
    return slot_coding_keywords(settings.kv_bits, settings.kv_group, settings.key_bits, settings.float_window,
                                settings.center_keys)


def _reading(policy: str | None, prefill: str | None) -> str | None:
    """The prefill mode a server's policy runs with: a policy ranked by reconstruction (``kvzip``)
    reads every prompt in one call, whatever ``--prefill`` says for the others (the executor opens
    such a sequence late). A streamed prefill (``bounded``) is read chunked: the engine schedules a
    prompt's chunks across its steps itself, and a request may run another policy."""
    if policy is not None and make_policy(policy).ranks_by_reconstruction:
        return "late"
    return "chunked" if prefill == "streamed" else prefill
