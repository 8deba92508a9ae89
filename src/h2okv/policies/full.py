"""``full``: keep every token (the reference every other policy is measured against)."""

from h2okv.policies.base import Policy


class FullPolicy(Policy):
    name = "full"
    evicts = False

    def decode_rule(self):
        return None  # it never evicts: no kernel rule to run

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):  # pragma: no cover - never asked
        raise AssertionError("full never evicts")
