"""Which policies the native kernels can run, and as what.

The kernels know two ways to fold attention mass into a score (add it, or replace the score with
it) and three ranks (the score, the score per query that saw the key, the ordinal). A policy
declares which it follows (``Policy.decode_rule()``: a ``ScoreRule``, computed from its options);
one that declares None, or a rule they do not know, runs the tensor-op step, so the kernels never
compute a rule they do not know.
The C decode step knows two rules more (``c_decode_rule``): a fold that fades the old score
first (``h2o:decay``: "decay") and ``rkv``'s rank from the keys ("rkv"), and so does the fused
Triton decode step (``core/triton_step.py``). The per-token scan does not (a decay applies once
per forward call, not per token; its keys are not at hand there).
tests/policies/test_declared_rules.py holds every policy's hooks to its declaration.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

ACC_NONE, ACC_ADD, ACC_REPLACE, ACC_DECAY = 0, 1, 2, 3
KEY_SCORE, KEY_MEAN, KEY_ORDINAL, KEY_RKV = 0, 1, 2, 3

# read-only tables (MappingProxyType): the kernels' vocabulary, not state
FOLDS = MappingProxyType({"add": ACC_ADD, "replace": ACC_REPLACE})
RANKS = MappingProxyType({"score": KEY_SCORE, "mean": KEY_MEAN, "ordinal": KEY_ORDINAL})
C_DECODE_FOLDS = MappingProxyType({**FOLDS, "decay": ACC_DECAY})
C_DECODE_RANKS = MappingProxyType({**RANKS, "rkv": KEY_RKV})


class DecodeRule(NamedTuple):
    """The C decode step's rule: the codes, and the policy's numbers they read."""

    acc: int
    key: int
    decay: float = 1.0  # ACC_DECAY: score <- decay * score + mass
    weight: float = 0.0  # KEY_RKV: weight * importance - (1 - weight) * redundancy


def native_rule(policy, folds=FOLDS, ranks=RANKS) -> tuple[int, int] | None:
    """``(accumulate code, key code)`` for ``policy``, or None when the kernels do not know its rule."""
    return _codes(policy, policy.decode_rule(), folds, ranks)


def c_decode_rule(policy) -> DecodeRule | None:
    """``native_rule`` for the C decode step, which also knows "decay" and "rkv"."""
    declared = policy.decode_rule()
    codes = _codes(policy, declared, C_DECODE_FOLDS, C_DECODE_RANKS)
    if codes is None:
        return None
    return DecodeRule(*codes, decay=float(declared.decay), weight=float(declared.weight))


def _codes(policy, declared, folds, ranks) -> tuple[int, int] | None:
    if declared is None or not policy.evicts:
        return None
    acc = folds.get(declared.fold) if policy.needs_scores else ACC_NONE
    key = ranks.get(declared.rank)
    if acc is None or key is None:
        return None
    # the C loops rank each head alone and start every new slot at score 0: a rank shared over
    # heads, or a starting score taken from the key (knorm), is a rule they do not know
    if policy.shared_heads or policy.scores_keys:
        return None
    return acc, key
