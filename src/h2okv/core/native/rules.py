"""Which policies the native kernels can run, and as what.

The kernels know two ways to fold attention mass into a score (add it, or replace the score with
it) and three ranks (the score, the score per query that saw the key, the ordinal). A policy
declares which it follows (``Policy.fold`` and ``Policy.rank``); one that declares something else
(None) runs the tensor-op step, so the kernels never compute a rule they do not know.
tests/policies/test_declared_rules.py holds every policy's hooks to its declaration.
"""

from __future__ import annotations

ACC_NONE, ACC_ADD, ACC_REPLACE = 0, 1, 2
KEY_SCORE, KEY_MEAN, KEY_ORDINAL = 0, 1, 2

FOLDS = {"add": ACC_ADD, "replace": ACC_REPLACE}
RANKS = {"score": KEY_SCORE, "mean": KEY_MEAN, "ordinal": KEY_ORDINAL}


def native_rule(policy) -> tuple[int, int] | None:
    """``(accumulate code, key code)`` for ``policy``, or None when the kernels do not know its rule."""
    acc = FOLDS.get(policy.fold) if policy.needs_scores else ACC_NONE
    key = RANKS.get(policy.rank)
    if acc is None or key is None or not policy.evicts:
        return None
    # the C loops rank each head alone and start every new slot at score 0: a rank shared over
    # heads, or a starting score taken from the key (knorm), is a rule they do not know
    if policy.shared_heads or policy.scores_keys:
        return None
    return acc, key
