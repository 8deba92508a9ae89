"""The policy interface: what an eviction policy decides, and nothing else.

One mechanism (``h2okv.core``) serves every policy. It writes tokens into slots, runs attention,
keeps each row's last ``recent`` tokens and its first ``sinks`` tokens out of reach, and frees the
lowest-ranked candidates until the budget holds. A policy answers, in tensor ops over a whole
layer:

- ``split``: how a (heavy, recent) budget is used (the total is always kept);
- ``sink_tokens``: how many first tokens of a sequence it protects (capped by the heavy part);
- ``needs_scores`` / ``score_queries`` / ``accumulate``: whether attention must hand back the
  probability mass each slot received, which queries of a chunk count, and how that mass
  updates the per-slot score (summed, replaced by the last query's, ...);
- ``eviction_key``: the rank of each slot (lower = evicted first); a policy that sets
  ``ranks_by_keys`` is also handed the layer's keys and live slots (``rkv``: a key's redundancy);
- ``decode_rule``: what ``accumulate`` and ``eviction_key`` compute, as a ``ScoreRule`` the
  compiled kernels know, or None (the tensor-op step runs the hooks themselves);
- ``prefill_scores``: optionally, scores for a whole prompt computed before it is chunked
  (SnapKV's look-back window, Expected Attention's query statistics; ``ranks_upfront`` says so);
- ``key_scores``: optionally, the score a token starts with, from its key alone, when it is
  written (Knorm; ``scores_keys`` says so); else it starts at zero;
- ``shared_heads``: whether the rank is averaged over the KV heads of a layer, so every head keeps
  the same tokens (option ``heads=shared`` of the score policies, as kvpress's TOVA).

Nothing is inferred from which hooks a subclass overrides: a subclass that changes ``accumulate``
or ``eviction_key`` says its ``decode_rule`` anew, and one that adds ``prefill_scores`` or
``key_scores`` sets ``ranks_upfront`` or ``scores_keys`` (tests/policies/test_declared_rules.py
holds every registered policy to this). A policy ranked by a reconstruction pass (``kvzip``)
follows ``ReconstructionPolicy`` (``reconstruction.py``) as well.

A policy is a dataclass and its options are its fields, each declared once with ``option``: name,
type (int, float or str) and default as any field's, the check and what a value must be in the
field's metadata. ``make_policy`` reads a spec's text by them, ``__post_init__`` checks every value
(given as keywords in Python or parsed from a spec, the same way), ``spec`` writes them back, and
every error names the policy and the option. ``heads`` is such a field too (``heads_option``)::

    @dataclass(eq=False)
    class SnapKVPolicy(HeavyHitters):
        window: int = option(32, check=lambda v: v >= 1, must_be=">= 1")
        pool: str = option("avg", choices=("avg", "max"), shown=False)
        heads: str = heads_option()

The fields' order is the spec's (``snapkv:16`` sets ``window``). A dataclass puts inherited fields
first, so a policy that takes another's hooks but not all its options derives from a class without
fields (``HeavyHitters``: h2o's hooks) and declares each of its options itself, in its own order.
``@dataclass(eq=False)``: a policy is one object, hashed by identity (a frozen ``LayerConfig`` that
holds one hashes it).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import ClassVar

import torch

from h2okv.errors import H2OError


@dataclass(frozen=True)
class Budget:
    """Slots per (sequence, layer, KV head): ``heavy`` ranked by the policy plus ``recent`` kept always."""

    heavy: int
    recent: int

    @property
    def total(self) -> int:
        return self.heavy + self.recent


@dataclass(frozen=True)
class ScoreRule:
    """What a policy's ``accumulate`` and ``eviction_key`` compute, declared for the compiled
    kernels (native C, Triton: ``core/native/rules.py``), which run a policy by this alone.

    ``fold``: how a step's mass joins the score: "add" it, "replace" the score with it, or "decay"
    (the score times ``decay``, then the mass added); None for a policy that takes no mass
    (``needs_scores`` False). ``rank``: what the eviction ranks by: the "score", the score per
    query that saw the key ("mean"), the "ordinal" (oldest first), or "rkv" (``weight`` times the
    importance less the rest times the keys' redundancy, ``rkv.py``)."""

    fold: str | None
    rank: str
    decay: float = 1.0
    weight: float = 0.0


# the types an option may have: a spec's text is read as one of them
OPTION_TYPES = {kind.__name__: kind for kind in (int, float, str)}
# what a value given in Python may be, for each type (a bool is not a number here)
ACCEPTED = {int: numbers.Integral, float: numbers.Real, str: str}


def option(default, *, check: Callable[[object], bool] | None = None, must_be: str = "",
           choices: tuple | None = None, shown: bool = True):
    """A policy option, declared once as a dataclass field: ``kernel: int = option(1, check=lambda
    v: v % 2 == 1, must_be="odd")``. ``check`` is what a valid value passes and ``must_be`` says it
    in the one-line error; ``choices`` gives both at once. ``shown``: always written into ``spec``
    (False: only when it is not the default, so an option added later leaves older specs as they were)."""
    if choices is not None:
        names = [str(choice) for choice in choices]
        check = tuple(choices).__contains__
        must_be = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    if check is None or not must_be:
        raise TypeError("an option says what a value must be: give check= and must_be=, or choices=")
    return field(default=default, metadata={"option": {"check": check, "must_be": must_be, "shown": shown}})


HEADS_CHOICES = {"own": False, "shared": True}


def heads_option():
    """``heads=own`` (each KV head keeps its own tokens, the default) or ``heads=shared``: the field
    of every policy that ranks slots (declared last, so a spec writes it last).

    Shared: the rank of a slot is the mean of the policy's key over the layer's KV heads, so every
    head evicts the same slot. Heads start with the same (empty) slot layout and every write and
    eviction then treats them alike, so the layouts stay aligned and the mean at slot level is the
    mean per token."""
    return option("own", choices=tuple(HEADS_CHOICES), shown=False)


@dataclass(frozen=True)
class Option:
    """One option of a policy as its field declares it (``option``): what ``make_policy`` reads a
    spec's text by, and what every value is checked against."""

    name: str
    type: type
    default: object
    check: Callable[[object], bool]
    must_be: str  # what a value must be, for the one-line error
    shown: bool

    def read(self, policy: str, text: str):
        """The value a spec's ``text`` gives (its check follows when the policy is built)."""
        try:
            return self.type(text)
        except ValueError:
            raise H2OError(f"policy {policy!r}: option {self.name}={text!r} is not a {self.type.__name__}") from None

    def accept(self, policy: str, value):
        """``value`` as the option's type if it is one (an int where a float is asked) and passes the
        check, else a one-line error naming the policy and the option."""
        if isinstance(value, bool) or not isinstance(value, ACCEPTED[self.type]):
            raise H2OError(f"policy {policy!r}: option {self.name}={value!r} is not a {self.type.__name__}")
        value = self.type(value)
        if not self.check(value):
            raise H2OError(f"{policy} {self.name} must be {self.must_be}, got {value!r}")
        return value


@functools.cache
def options_of(cls: type) -> tuple[Option, ...]:
    """The options ``cls``'s fields declare, in field order; a ``TypeError`` for a class whose
    declaration would not work (once per class: the classes do not change)."""
    for part in cls.__mro__:
        if any(isinstance(value, Field) for value in vars(part).values()):
            raise TypeError(f"{part.__name__} declares fields: decorate it with @dataclass(eq=False)")
    if cls.__hash__ is None:
        raise TypeError(f"{cls.__name__}: declare it with @dataclass(eq=False), not @dataclass")
    found = []
    for f in fields(cls):
        if "option" not in f.metadata:
            continue
        kind = OPTION_TYPES.get(f.type) if isinstance(f.type, str) else f.type
        if kind not in OPTION_TYPES.values():
            raise TypeError(f"{cls.__name__}.{f.name}: an option is an int, a float or a str, not {f.type}")
        found.append(Option(f.name, kind, f.default, **f.metadata["option"]))
        found[-1].accept(cls.name, f.default)  # a default that fails its own check is a typo
    return tuple(found)


@dataclass(eq=False)
class Policy:
    """The base of every policy (see the module docstring); a dataclass whose fields are its options
    (none here) and the ``seed`` of a policy that draws (``random``)."""

    #: the random policy's seed; a keyword, so that a policy's first option is its first argument
    seed: int = field(default=0, kw_only=True)

    name: ClassVar[str] = ""
    #: whether the attention must produce per-slot probability mass (score-based policies); the
    #: others can use the fused SDPA kernel
    needs_scores: ClassVar[bool] = False
    #: ``full`` never evicts
    evicts: ClassVar[bool] = True
    #: first tokens of a sequence that are never evicted (attention sinks); the core protects
    #: ``min(sink_tokens, heavy)`` of them so a candidate always remains
    sink_tokens: ClassVar[int] = 0
    #: which queries of a chunk add to the scores: "all" real queries, or only each row's "last"
    score_queries: ClassVar[str] = "all"
    #: whether ``eviction_key`` depends only on its arguments (not on how many calls came before
    #: or the buffer's shape), so the per-token scan (``core/scan.py``) may rank keys in its own layout
    scan_safe: ClassVar[bool] = True
    #: rank by the mean over the layer's KV heads (one kept set per layer): ``heads=shared``
    #: (``heads_option``), set when such a policy is built
    shared_heads = False
    #: the prompt is ranked by a reconstruction pass (``h2okv.reconstruct``): such a policy is a
    #: ``ReconstructionPolicy`` (``reconstruction.py``), and the core asks its probe hooks only then
    ranks_by_reconstruction: ClassVar[bool] = False
    #: ``prefill_scores`` ranks a whole multi-token call before it is chunked (``snapkv``, ``expected``)
    ranks_upfront: ClassVar[bool] = False
    #: ranks a prompt's piece by the mass a probe's queries pay it (``smooth_held`` pools it):
    #: ``prefill="streamed"`` (``core/streamed.py``) takes such a policy
    streams: ClassVar[bool] = False
    #: ``key_scores`` gives a written token a starting score from its key (``knorm``)
    scores_keys: ClassVar[bool] = False
    #: ``eviction_key`` also reads the layer's keys and which slots are live (``rkv``: how alike a
    #: key is to the others kept): the core then passes ``keys`` ``[B, H, cap, D]`` and ``valid``
    #: ``[B, H, cap]`` as keywords (the other policies' key is asked without them)
    ranks_by_keys: ClassVar[bool] = False
    #: pools its prompt rankings by words too (option ``words=1`` of ``snapkv`` and ``kvzip``): every
    #: token of a word ranks at least at the word's best unpooled score (``core/words.py``); the
    #: cache then records the ids
    words = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # Fail closed: a class that changes how scores fold or rank must say which rule the kernels
        # may run (or None: the tensor-op step), or the C and Triton steps would run its parent's
        # rule, not its hooks. Nothing is derived from the overrides: a missing declaration is an error.
        own = vars(cls)
        if any(hook in own for hook in ("accumulate", "eviction_key")) and "decode_rule" not in own:
            hooks = " and ".join(hook for hook in ("accumulate", "eviction_key") if hook in own)
            raise TypeError(f"{cls.__name__} overrides {hooks}: declare its decode_rule() in the same class "
                            f"(None runs the tensor-op step; the kernels otherwise run the parent's rule)")

    def __post_init__(self):
        # a value given in Python is held to what a spec's would be: its type, then its check
        values = {opt.name: opt.accept(self.name, getattr(self, opt.name)) for opt in self.options()}
        for name, value in values.items():
            setattr(self, name, value)
        if "heads" in values:
            self.shared_heads = HEADS_CHOICES[values["heads"]]

    @classmethod
    def options(cls) -> tuple[Option, ...]:
        """The policy's options, read from its fields in order (the first may be given without its name)."""
        return options_of(cls)

    @property
    def spec(self) -> str:
        """The name with its options, as ``make_policy`` parses it (e.g. ``snapkv:window=16``)."""
        values = [(opt, getattr(self, opt.name)) for opt in self.options()]
        written = [f"{opt.name}={value}" for opt, value in values if opt.shown or value != opt.default]
        return f"{self.name}:{','.join(written)}" if written else self.name

    @property
    def slots_above_budget(self) -> int:
        """Slots a (row, head) may hold on top of its budget: 0, except a reconstruction-ranked
        policy's tail (``ReconstructionPolicy``). The server sizes every request by it."""
        return 0

    def decode_rule(self) -> ScoreRule | None:
        """The rule ``accumulate`` and ``eviction_key`` follow, from this policy's options, or None:
        a rule the compiled kernels do not implement, which the tensor-op step runs by the hooks
        themselves (the default: a policy says its rule)."""
        return None

    def split(self, heavy: int, recent: int) -> Budget:
        """How a (heavy, recent) budget is used by this policy; the total is always kept."""
        return Budget(heavy, recent)

    def accumulate(self, score: torch.Tensor, mass: torch.Tensor) -> None:
        """Fold one step's (or chunk's) probability mass ``[B, H, cap]`` into ``score`` in place."""
        score.add_(mass)

    def eviction_key(self, score, ordinal, n_real, layer_idx: int = 0) -> torch.Tensor:
        """Rank ``[B, H, cap]`` slots of one layer; the lowest candidates are evicted.

        ``n_real`` is ``[B, 1, 1]``: real tokens of each sequence seen so far (this step's included).
        A policy with ``ranks_by_keys`` takes two keywords more: ``keys`` ``[B, H, cap, D]``, the
        stored keys, and ``valid`` ``[B, H, cap]``, the live slots (free and pad slots are not).
        """
        raise NotImplementedError

    def prefill_scores(self, query, key_new, old_keys, old_valid, new_real, scaling, value_new=None, old_values=None,
                       old_in_order=None):
        """Scores for a multi-token forward call, computed before it is chunked, or None (the
        default: scores come from each chunk's attention). See ``snapkv.py``, ``expected.py``.
        ``old_in_order`` ``[B]``: a row's old slot count where they are its first tokens in slot
        order (nothing evicted yet), else -1 (None: no row's are)."""
        return None

    def bind(self, model) -> None:
        """Called by the cache with its model, for a policy that needs the model's facts (RoPE's
        frequencies for ``expected``); most need none."""

    def key_scores(self, keys: torch.Tensor) -> torch.Tensor | None:
        """The scores ``[B, H, m]`` tokens start with, from their keys ``[B, H, m, D]`` alone, or
        None (the default: they start at zero). Asked whenever tokens are written. See ``knorm.py``."""
        return None

