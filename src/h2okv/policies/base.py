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

A policy's options are declared once, as ``Option``s in ``declared`` (name, type, default, check):
``make_policy`` parses them, ``__init__`` checks and sets them, ``spec`` writes them back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Option:
    """One option of a policy, declared once: ``make_policy`` parses it (``snapkv:window=16``), the
    policy checks and sets it, and ``spec`` writes it back."""

    name: str
    type: type
    default: object
    check: Callable[[object], bool] = lambda value: True
    rule: str = ""  # what a value must be, for the one-line error
    attribute: str | None = None  # the attribute it sets (default: its name)
    shown: bool = True  # written into ``spec`` always (False: only when it is not the default)


class Policy:
    name: str = ""
    #: whether the attention must produce per-slot probability mass (score-based policies); the
    #: others can use the fused SDPA kernel
    needs_scores: bool = False
    #: ``full`` never evicts
    evicts: bool = True
    #: first tokens of a sequence that are never evicted (attention sinks); the core protects
    #: ``min(sink_tokens, heavy)`` of them so a candidate always remains
    sink_tokens: int = 0
    #: which queries of a chunk add to the scores: "all" real queries, or only each row's "last"
    score_queries: str = "all"
    #: whether ``eviction_key`` depends only on its arguments (not on how many calls came before
    #: or the buffer's shape), so the per-token scan (``core/scan.py``) may rank keys in its own layout
    scan_safe: bool = True
    #: the policy's own options, in order (the first may be given without its name)
    declared: tuple[Option, ...] = ()
    #: whether it takes ``heads=own|shared`` (the ranking policies; see ``heads_option``)
    ranks_heads: bool = False
    #: the options ``make_policy`` accepts (name -> type): ``declared``, then ``heads`` (derived)
    options: dict[str, type] = {}
    #: rank by the mean over the layer's KV heads (one kept set per layer); see ``heads_option``
    shared_heads: bool = False
    #: the prompt is ranked by a reconstruction pass (``h2okv.reconstruct``): such a policy is a
    #: ``ReconstructionPolicy`` (``reconstruction.py``), and the core asks its probe hooks only then
    ranks_by_reconstruction: bool = False
    #: tokens kept whole on top of the budget after that ranking (``ReconstructionPolicy.tail``);
    #: here as well because the server sizes every request by it (``serve/engine.py``)
    tail: int = 0
    #: ``prefill_scores`` ranks a whole multi-token call before it is chunked (``snapkv``, ``expected``)
    ranks_upfront: bool = False
    #: ``key_scores`` gives a written token a starting score from its key (``knorm``)
    scores_keys: bool = False
    #: ``eviction_key`` also reads the layer's keys and which slots are live (``rkv``: how alike a
    #: key is to the others kept): the core then passes ``keys`` ``[B, H, cap, D]`` and ``valid``
    #: ``[B, H, cap]`` as keywords (the other policies' key is asked without them)
    ranks_by_keys: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.options = {o.name: o.type for o in cls.declared} | ({"heads": str} if cls.ranks_heads else {})
        # Fail closed: a class that changes how scores fold or rank must say which rule the kernels
        # may run (or None: the tensor-op step), or the C and Triton steps would run its parent's
        # rule, not its hooks. Nothing is derived from the overrides: a missing declaration is an error.
        own = vars(cls)
        if any(hook in own for hook in ("accumulate", "eviction_key")) and "decode_rule" not in own:
            hooks = " and ".join(hook for hook in ("accumulate", "eviction_key") if hook in own)
            raise TypeError(f"{cls.__name__} overrides {hooks}: declare its decode_rule() in the same class "
                            f"(None runs the tensor-op step; the kernels otherwise run the parent's rule)")

    def __init__(self, seed: int = 0, **options):
        self.seed = seed
        unknown = set(options) - set(self.options)
        if unknown:
            raise H2OError(f"policy {self.name!r} has no option {', '.join(sorted(unknown))}")
        if "heads" in options:
            self.shared_heads = heads_option(self.name, options["heads"])
        for option in self.declared:
            value = option.type(options.get(option.name, option.default))
            if not option.check(value):
                raise H2OError(f"{self.name} {option.name} must be {option.rule}, got {value}")
            setattr(self, option.attribute or option.name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"

    @property
    def spec(self) -> str:
        """The name with its options, as ``make_policy`` parses it (e.g. ``snapkv:window=16``)."""
        options = self.spec_options() + (["heads=shared"] if self.shared_heads else [])
        return f"{self.name}:{','.join(options)}" if options else self.name

    def spec_options(self) -> list[str]:
        """The policy's own options as ``NAME=VALUE`` strings (``heads`` is added by ``spec``)."""
        values = [(o, getattr(self, o.attribute or o.name)) for o in self.declared]
        return [f"{o.name}={value}" for o, value in values if o.shown or value != o.default]

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


HEADS_CHOICES = {"own": False, "shared": True}


def heads_option(policy: str, value: str) -> bool:
    """``heads=own`` (each KV head keeps its own tokens, the default) or ``heads=shared``.

    Shared: the rank of a slot is the mean of the policy's key over the layer's KV heads, so every
    head evicts the same slot. Heads start with the same (empty) slot layout and every write and
    eviction then treats them alike, so the layouts stay aligned and the mean at slot level is the
    mean per token."""
    if value not in HEADS_CHOICES:
        raise H2OError(f"policy {policy!r}: heads must be own or shared, got {value!r}")
    return HEADS_CHOICES[value]
