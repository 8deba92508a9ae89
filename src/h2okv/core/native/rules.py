"""Which policies the native kernels can run, and as what.

The kernels know two ways to fold attention mass into a score (add it, or replace the score with
it) and three ranks (the score, the score per query that saw the key, the ordinal). A policy runs
natively when its ``accumulate`` and ``eviction_key`` are, by identity, hooks listed here; any
other policy (a subclass that overrides a hook, a new policy) runs the eager path, so the native
path can never compute a rule it does not know.
"""

from __future__ import annotations

from functools import cache

ACC_NONE, ACC_ADD, ACC_REPLACE = 0, 1, 2
KEY_SCORE, KEY_MEAN, KEY_ORDINAL = 0, 1, 2


@cache
def _tables():
    from h2okv.policies import H2OMeanPolicy, H2OPolicy, LocalPolicy, Policy, SinkPolicy, TOVAPolicy

    accumulate = {Policy.accumulate: ACC_ADD, TOVAPolicy.accumulate: ACC_REPLACE}
    keys = {H2OPolicy.eviction_key: KEY_SCORE, TOVAPolicy.eviction_key: KEY_SCORE, H2OMeanPolicy.eviction_key: KEY_MEAN,
            LocalPolicy.eviction_key: KEY_ORDINAL, SinkPolicy.eviction_key: KEY_ORDINAL}
    return accumulate, keys


def native_rule(policy) -> tuple[int, int] | None:
    """``(accumulate code, key code)`` for ``policy``, or None when the kernels do not know its rule."""
    from h2okv.policies import Policy

    accumulate, keys = _tables()
    cls = type(policy)
    acc = accumulate.get(cls.accumulate) if policy.needs_scores else ACC_NONE
    key = keys.get(cls.eviction_key)
    if acc is None or key is None or not policy.evicts:
        return None
    # the C loops rank each head alone and start every new slot at score 0: a rank shared over
    # heads, or a starting score taken from the key (knorm), is a rule they do not know
    if getattr(policy, "shared_heads", False) or type(policy).key_scores is not Policy.key_scores:
        return None
    return acc, key
