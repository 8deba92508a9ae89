"""``h2o``: heavy hitters, the non-recent token with the least accumulated attention goes (Algorithm 1)."""

from h2okv.policies.base import Policy


class H2OPolicy(Policy):
    name = "h2o"
    needs_scores = True
    ranks_heads = True
    rank = "score"

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return score
