"""``CacheSettings``: everything an ``H2OCache`` is built with, as one frozen, checked value.

A cache's settings used to travel as keyword dicts and be checked where they landed: the library,
the command line, the server and each evaluation spelled the budget rules out again. Now they
build one value here, and the checks that need no model live in its ``__post_init__``, once:

    settings = CacheSettings.from_recipe("bounded", budget=0.2)      # a recipe, then overrides
    settings = CacheSettings.build(policy="h2o", budget=256)          # keywords, as H2OCache takes
    H2OCache(model, settings)  ==  H2OCache(model, policy="h2o", budget=256)
    settings.resolve(prompt_len=2048)  # (heavy, recent) slots for one prompt

The value is what the user asked for, completed: a recipe's keywords and the library's defaults
are filled in, a recipe without a budget keeps its fifth, and ``recent_share`` is the share a
one-argument budget is split by (None for a budget given in parts). ``describe()`` is what
``stats()`` and every JSON row record.

Errors are ``SettingError``s (``h2okv.vocabulary``): one message, said in the caller's words
(``budget=`` in Python, ``--budget`` on the command line, ``h2o.budget`` over HTTP).

Torch-free to import (the command line builds its flags from the fields before torch loads); the
checks import the policies when a value is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from h2okv.budget_spec import DEFAULT_BUDGET_FLOOR, DEFAULT_RECENT_SHARE, budget_of  # noqa: F401 (re-exported)
from h2okv.byte_budget import Geometry, budget_for_bytes, looks_like_bytes, parse_bytes_budget
from h2okv.errors import H2OError
from h2okv.recipes import BYTES_CENTER_KEYS, BYTES_CODING, expand
from h2okv.vocabulary import SettingError

# the defaults that other modules also name; kept here so importing them loads no torch
DEFAULT_CHUNK = 512
PREFILL_MODES = ("chunked", "late", "streamed")
HEAD_SPLITS = ("uniform", "adaptive", "layers")
DEFAULT_HEAD_FLOOR = 0.2  # Ada-KV's safeguard share (core/head_budget.py)
PART_NAMES = ("heavy", "recent", "heavy_ratio", "recent_ratio")
DEFAULT_KV_GROUP = 32  # channels per scale of quantized slots (core/quant.py)
KV_BITS = (8, 4, 2)  # the bits a quantized slot's key or value may take
# the settings of quantized slots, the flags every command that codes slots takes together
CODING_FIELDS = ("kv_bits", "key_bits", "kv_group", "float_window", "center_keys")


def slot_coding_keywords(kv_bits: int | None, kv_group: int = DEFAULT_KV_GROUP, key_bits: int | None = None,
                         float_window: int = 0, center_keys: bool = False) -> dict:
    """``H2OCache``'s keywords for quantized slots (none for ``kv_bits=None``; ``key_bits`` only
    where given): what the server, ``eval reasoning`` and ``eval ppl`` hand every cache they build."""
    if kv_bits is None:
        return {}
    coding = {"kv_bits": kv_bits, "kv_group": kv_group}
    if key_bits is not None:
        coding["key_bits"] = key_bits
    if float_window:
        coding["float_window"] = float_window
    if center_keys:
        coding["center_keys"] = True
    return coding


def coding_label(kv_bits: int | None, key_bits: int | None = None, kv_group: int = DEFAULT_KV_GROUP,
                 float_window: int = 0, center_keys: bool = False) -> str | None:
    """How quantized slots are named in a row's label: ``4``, ``k8v4`` (keys in other bits),
    ``4/64`` (another group), ``k8v4+f32`` (a float window of 32 tokens), ``4+ck`` (centered keys);
    None for the model's dtype."""
    if kv_bits is None:
        return None
    bits = f"{kv_bits}" if key_bits in (None, kv_bits) else f"k{key_bits}v{kv_bits}"
    bits = bits if kv_group == DEFAULT_KV_GROUP else f"{bits}/{kv_group}"
    bits = f"{bits}+f{float_window}" if float_window else bits
    return f"{bits}+ck" if center_keys else bits


def _setting(default, help: str, kind: str = "text", recipe_sets: bool = False, **more):
    """A field with what its command-line flag needs (``cli.args.add_cache_args`` builds the flags
    from these, once): ``help`` in the flags' words, ``kind`` (how the flag's text is read),
    ``recipe_sets``: a recipe may fill it in (its help says so); ``shown``: what the help gives as
    the default where the field's own default (None) does not say it."""
    return field(default=default, metadata={"help": help, "kind": kind, "recipe_sets": recipe_sets, **more})


@dataclass(frozen=True)
class CacheSettings:
    """What an ``H2OCache`` keeps and how: build it with ``build`` or ``from_recipe``."""

    policy: object = _setting("h2o", "an eviction policy, options after a colon, e.g. snapkv:window=16 (or a Policy "
                              "object, in Python)", recipe_sets=True, flag=False)
    budget: float | int | None = _setting(
        None, "the cache budget: a fraction of the prompt in (0, 1] (0.2) or a whole number of slots per layer and "
              "KV head (256; h2o needs at least 2)", kind="budget", shown="0.2 split half and half, the paper's 10%% heavy + 10%% "
                                                              "recent")
    bytes: float | int | str | None = _setting(
        None, "the budget in bytes instead: a fraction of a full 16-bit cache's bytes of the same tokens (0.1) or bytes "
              "per sequence (4MiB, every layer's keys and values, scales included; --budget 4MiB says the same); the "
              "slots are quantized (8-bit keys, 4-bit values unless --kv-bits says otherwise) and as many kept as fit",
        kind="bytes", shown="none")
    recent_share: float | None = _setting(None, "share of --budget kept for the most recent tokens", kind="share",
                                          recipe_sets=True, shown=DEFAULT_RECENT_SHARE)
    budget_floor: int = _setting(DEFAULT_BUDGET_FLOOR, "the fewest slots a fractional budget keeps on a short prompt "
                                                       "(0: none)", kind="int")
    heavy: int | None = _setting(None, "heavy-hitter slots per layer/head (the older spelling of a budget)", kind="int")
    recent: int | None = _setting(None, "recent-token slots per layer/head", kind="int")
    heavy_ratio: float | None = _setting(None, "heavy slots as a fraction of the prompt", kind="float", shown=0.1)
    recent_ratio: float | None = _setting(None, "recent slots as a fraction of the prompt", kind="float", shown=0.1)
    chunk_size: int = _setting(DEFAULT_CHUNK, "prefill chunk length", kind="positive")
    seed: int = _setting(0, "the random policy's seed", kind="int", flag=False)  # commands' --seed samples
    prefill: str = _setting(
        "chunked", "chunked: evict after every prefill chunk (bounded: budget + chunk slots); late: read the whole "
                   "prompt with exact attention, then rank once (a layer holds budget + prompt while it runs); "
                   "streamed: read a long prompt through the model in pieces of the chunk size, each ranked by the "
                   "prompt's last tokens (snapkv's window): memory budget + one piece at any length",
        kind="choice", choices=PREFILL_MODES, recipe_sets=True)
    positions: str = _setting(
        "true", "true or rolling (rolling:shift, rolling:order): rolling keeps positions inside the model's context "
                "window, so generation goes on past it in constant memory", recipe_sets=True)
    head_budgets: str = _setting(
        "uniform", "uniform: every KV head keeps the same slots; adaptive: each layer's ranked slots shared out among "
                   "its heads by the policy's rank (Ada-KV); layers: the whole cache's slots among every layer and "
                   "head (kvzip only)", kind="choice", choices=HEAD_SPLITS, recipe_sets=True)
    head_floor: float = _setting(DEFAULT_HEAD_FLOOR, "with uneven head budgets, the share of a uniform head's slots "
                                                     "every head keeps first", kind="share", recipe_sets=True)
    compileable: bool = _setting(False, "decode steps at the budget as one compiled graph", kind="switch", flag=False)
    kv_bits: int | None = _setting(None, "store the kept keys and values in 8, 4 or 2 bits, per token in groups of "
                                         "--kv-group channels with a float16 scale and low each (none: the model's "
                                         "dtype)", kind="int", shown="none")
    key_bits: int | None = _setting(None, "with --kv-bits: the keys in these bits instead (8 with --kv-bits 4: keys "
                                          "carry outlier channels, values code well in 4)", kind="int",
                                    shown="--kv-bits")
    kv_group: int = _setting(DEFAULT_KV_GROUP, "channels that share one scale with --kv-bits (at most the head dimension)",
                             kind="positive")
    float_window: int = _setting(0, "with --kv-bits: each sequence's last N tokens also kept in the model's dtype, "
                                    "read from there until newer ones take their place, then from their codes "
                                    "(KIVI's full-precision recent window)", kind="int")
    center_keys: bool | None = _setting(
        None, "with --kv-bits: code each key less its channel's mean over the sequence's first 256 tokens (at most "
              "its first chunk), turned to the key's position (a RoPE model's key offsets are then not coded: 8/4 "
              "bits read Hamlet at 0.99x full's perplexity, not 1.03x)", kind="switch", shown="on for a budget in bytes where the model has RoPE")
    protect_prompt: bool = _setting(False, "keep the prompt whole: the budget applies to the generated tokens (the "
                                           "KV reported counts both)", kind="switch")
    #: the recipe the value was expanded from (a label: its keywords are already in the fields)
    recipe: str | None = None

    # -- building ------------------------------------------------------------------------------------
    @classmethod
    def build(cls, policy=None, *, recipe: str | None = None, **keywords) -> CacheSettings:
        """The value ``H2OCache(model, policy, recipe=..., **keywords)`` is built with: the recipe's
        keywords, replaced by those given that are not None, over the defaults."""
        unknown = sorted(set(keywords) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise H2OError(f"unknown cache setting(s): {', '.join(unknown)}")
        given = {name: value for name, value in keywords.items() if value is not None}
        if looks_like_bytes(given.get("budget")):  # budget="4MiB": bytes per sequence
            if "bytes" in given:
                raise SettingError("give either {budget} in bytes or {bytes}, not both")
            given["bytes"] = given.pop("budget")
        if "bytes" in given and (spelled := [n for n in ("budget", *PART_NAMES) if n in given]):
            raise SettingError("give either {bytes} or " + "/".join("{" + n + "}" for n in spelled) + ", not both")
        if "bytes" in given:  # the bytes asked are a ceiling: no floor raises a short prompt's slots above them
            given.setdefault("budget_floor", 0)
        shape = expand(recipe, policy=policy, **{k: given.pop(k) for k in list(given) if k in _RECIPE_KEYS})
        if keywords.get("recent_share") is None and any(name in given for name in PART_NAMES):
            shape.pop("recent_share", None)  # the recipe's share splits a budget, not parts given as such
        return cls(recipe=recipe, **shape, **given)

    @classmethod
    def from_recipe(cls, name: str, budget: float | int | None = None, **overrides) -> CacheSettings:
        """Recipe ``name`` (``h2okv.recipes``) at ``budget`` (its fifth when None), ``overrides``
        replacing its parts."""
        return cls.build(recipe=name, budget=budget, **overrides)

    def replace(self, **changes) -> CacheSettings:
        """A copy with ``changes``, checked again (a budget given replaces the parts, and the other
        way round: a value holds one spelling)."""
        if changes.get("budget") is not None:
            changes = {**dict.fromkeys(PART_NAMES), "bytes": None, **changes}
        elif any(changes.get(name) is not None for name in PART_NAMES):
            changes = {"budget": None, "recent_share": None, "bytes": None, **changes}
        return dataclasses.replace(self, **changes)

    # -- the checks that need no model, in one place ---------------------------------------------------
    def __post_init__(self):
        from h2okv.budget_spec import BudgetSpec
        from h2okv.core.positions import check_positions
        from h2okv.policies import Policy, make_policy

        chosen = self.policy if isinstance(self.policy, Policy) else make_policy(self.policy, seed=self.seed)
        set_ = object.__setattr__.__get__(self)
        set_("policy", self.policy if isinstance(self.policy, Policy) else chosen.spec)
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise H2OError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.prefill not in PREFILL_MODES:
            raise H2OError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {self.prefill!r}")
        if self.protect_prompt and (chosen.ranks_by_reconstruction or self.head_budgets != "uniform"):
            raise H2OError(f"protect_prompt keeps the prompt whole and ranks what follows: it takes a policy that "
                           f"ranks by attention and uniform head budgets, not {chosen.spec!r} with "
                           f"head_budgets={self.head_budgets}")
        parts = {name: getattr(self, name) for name in PART_NAMES}
        if self.bytes is not None:
            self._take_bytes(chosen)
        if self.bytes is None or self.budget is not None:  # bytes are slots once a model's shape says how many
            budget, share = budget_of(chosen, self.budget, self.recent_share, parts, defaulted=self.recipe is not None)
            set_("budget", budget)
            set_("recent_share", share)
        BudgetSpec.build(chosen, floor=self.budget_floor, **parts)  # the parts' own rules
        self._check_head_split(chosen)
        if self.prefill == "streamed":
            self._check_streamed(chosen)
        if chosen.ranks_by_reconstruction and self.prefill != "late":
            raise H2OError(f"policy {chosen.spec!r} ranks the whole prompt after reading it: use prefill=late "
                           f"(--prefill late)")
        rolling = check_positions(chosen, self.positions) is not None
        self._check_kv_bits(rolling)
        if rolling and self.compileable:
            raise H2OError("compileable=True takes true positions only: the rolling positions' hook reads padding "
                           "from a 2D mask, and generate hands a compileable cache a 4D one")

    def _take_bytes(self, policy) -> None:
        """A budget in bytes: its value checked (``byte_budget``), the slots' coding filled in
        (``BYTES_CODING`` unless ``kv_bits`` is given) and the recent share a budget's."""
        set_ = object.__setattr__.__get__(self)
        if not policy.evicts:
            raise SettingError("policy {name!r} keeps every token; do not give it {bytes}", name=policy.name)
        set_("bytes", parse_bytes_budget(self.bytes))
        if isinstance(self.bytes, float) and self.float_window:
            raise SettingError("a float window holds {window} tokens whatever a prompt's length, so no fraction of "
                               "its bytes holds it: give {bytes} per sequence (e.g. 4MiB) with {float_window}",
                               window=self.float_window)
        if self.kv_bits is None:
            set_("kv_bits", BYTES_CODING["kv_bits"])
            set_("key_bits", self.key_bits or BYTES_CODING["key_bits"])
        if self.budget is None and self.recent_share is None:
            set_("recent_share", DEFAULT_RECENT_SHARE)

    def for_model(self, config) -> CacheSettings:
        """The value with a budget in bytes turned into the budget a cache keeps for ``config``'s
        model (a transformers config): a fraction of each prompt or slots per layer and KV head,
        ``bytes`` kept as what was asked, and the keys centered unless ``center_keys`` says otherwise
        where the model turns them with RoPE (``BYTES_CENTER_KEYS``). Any other value is returned as it is."""
        if self.bytes is None or self.budget is not None:
            return self
        from h2okv.budget_spec import least_slots
        from h2okv.core.rope import has_static_rope

        policy = self.policy_object()
        bits, keys = self.kv_bits, self.key_bits or self.kv_bits
        center = self.center_keys if self.center_keys is not None else BYTES_CENTER_KEYS and has_static_rope(config)
        budget = budget_for_bytes(self.bytes, Geometry.of(config), keys, bits, self.kv_group,
                                  least=least_slots(policy, self.recent_share), window=self.float_window,
                                  center=center)
        return dataclasses.replace(self, budget=budget, center_keys=center)

    def _check_kv_bits(self, rolling: bool) -> None:
        window = self.float_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise SettingError("{float_window} must be a whole number of tokens >= 0, got {got}", got=repr(window))
        if self.kv_bits is None:
            if self.key_bits is not None:
                raise H2OError("key_bits sets the keys' bits of quantized slots: give kv_bits (the values') too")
            if self.center_keys:
                raise SettingError("{center_keys} centers the keys of quantized slots: give {kv_bits} too")
            if window:
                raise SettingError("{float_window} keeps the recent tokens of quantized slots in float: give {kv_bits} too")
            return
        for name in ("kv_bits", "key_bits"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value not in KV_BITS):
                raise H2OError(f"{name} must be one of {', '.join(map(str, KV_BITS))} (or none), got {value!r}")
        if isinstance(self.kv_group, bool) or not isinstance(self.kv_group, int) or self.kv_group < 1:
            raise H2OError(f"kv_group must be a whole number >= 1, got {self.kv_group!r}")
        if rolling:
            raise H2OError("kv_bits takes true positions: rolling positions rotate the kept keys in place, and a "
                           "quantized key would be coded again at every rotation")

    def _check_streamed(self, policy) -> None:
        """A streamed prefill ranks each piece by the prompt's last ``window`` tokens
        (``core/streamed.py``): a window policy, one split per layer, true positions."""
        if not policy.streams:
            raise H2OError(f"prefill=streamed ranks each piece by the prompt's last tokens, which needs a policy with "
                           f"an observation window (snapkv), not {policy.spec!r}")
        if self.head_budgets != "uniform" or self.positions != "true" or self.protect_prompt:
            raise H2OError("prefill=streamed takes uniform head budgets, true positions and no protect_prompt")

    def _check_head_split(self, policy) -> None:
        mode, floor = self.head_budgets, self.head_floor
        if mode not in HEAD_SPLITS:
            raise H2OError(f"head_budgets must be one of {', '.join(HEAD_SPLITS)}, got {mode!r}")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not 0.0 <= floor <= 1.0:
            raise H2OError(f"head_floor must be a number in [0, 1], got {floor!r}")
        if getattr(policy, "ceiling", 0) and mode != "layers":
            raise H2OError(f"policy {policy.spec!r} caps each head's share of the whole cache's slots: give "
                           f"head_budgets=layers (--head-budgets layers)")
        if mode == "uniform":
            return
        if mode == "layers" and not policy.ranks_by_reconstruction:
            raise H2OError(f"head_budgets=layers shares slots among all layers, which needs every layer ranked at "
                           f"once (kvzip's reconstruction); {policy.spec!r} ranks layer by layer: use adaptive")
        by_key = policy.scores_keys  # knorm: ranked by each key alone
        upfront = by_key or policy.ranks_upfront  # a whole call, before chunks
        if not policy.evicts or not (policy.needs_scores or by_key):  # local, sink, random rank no tokens
            raise H2OError(f"head_budgets=adaptive needs a ranking policy (h2o, tova, snapkv, knorm, ...), "
                           f"not {policy.name!r}")
        if policy.shared_heads:
            raise H2OError(f"head_budgets=adaptive shares slots among heads that keep their own tokens; "
                           f"{policy.spec!r} keeps one set per layer")
        if self.prefill == "chunked" and (not upfront or self.chunk_size == 1):
            raise H2OError(f"head_budgets=adaptive with chunked prefill needs a policy that ranks the whole "
                           f"prompt before it is chunked (snapkv, knorm, expected) and chunk_size > 1; "
                           f"{policy.spec!r} with chunk_size {self.chunk_size}: use prefill=late (--prefill late)")

    # -- what the value means ----------------------------------------------------------------------------
    def policy_object(self):
        """The policy (a fresh one for a spec; the very object for a ``Policy`` given as such)."""
        from h2okv.policies import Policy, make_policy

        return self.policy if isinstance(self.policy, Policy) else make_policy(self.policy, seed=self.seed)

    @property
    def policy_spec(self) -> str:
        return self.policy if isinstance(self.policy, str) else self.policy.spec

    def budget_parts(self, policy=None) -> dict:
        """The budget as the heavy/recent keywords it stands for (none: the paper's 10% + 10%);
        ``policy``: this value's policy when the caller has built it already."""
        from h2okv.budget_spec import budget_keywords

        if self.bytes is not None and self.budget is None:
            raise H2OError("a budget in bytes becomes slots by the model's shape: resolve it with "
                           "settings.for_model(model.config) (H2OCache does)")
        if self.budget is not None:
            return budget_keywords(self.budget, self.recent_share, policy or self.policy_object())
        return {name: getattr(self, name) for name in PART_NAMES if getattr(self, name) is not None}

    def budget_spec(self, policy=None):
        """The ``BudgetSpec`` the cache's rows take their slots from."""
        from h2okv.budget_spec import BudgetSpec

        policy = policy or self.policy_object()
        return BudgetSpec.build(policy, floor=self.budget_floor, **self.budget_parts(policy))

    def resolve(self, prompt_len: int) -> tuple[int | None, int | None]:
        """``(heavy, recent)`` slots for a prompt of ``prompt_len`` tokens; ``(None, None)`` for a
        policy that keeps every token."""
        policy = self.policy_object()
        if not policy.evicts:
            return None, None
        return self.budget_spec(policy).resolve(prompt_len)

    def describe(self) -> dict:
        """The value as plain data, for ``stats()`` and every JSON row: the fields that differ from
        the defaults, the policy and recipe always."""
        row = {"policy": self.policy_spec, "recipe": self.recipe}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in row and value != f.default:
                row[f.name] = value
        return row


# the keywords a recipe may set (h2okv.recipes); the rest are given as they are
_RECIPE_KEYS = ("prefill", "positions", "head_budgets", "head_floor", "recent_share")
