"""``h2o-mean``: accumulated attention divided by the number of queries that saw the token.

H2O's sum favours old tokens: a token read 1000 queries ago has had 1000 chances to collect mass,
one read 10 ago only 10. Dividing by the count of real queries that attended to it
(``n_real - ordinal``: every later query of the sequence, itself included) ranks by the mean
attention instead. Evicted tokens are seen by no later query, but they are gone, so the count
of a live token is exact.
"""

from dataclasses import replace

from h2okv.policies.h2o import H2OPolicy


class H2OMeanPolicy(H2OPolicy):
    name = "h2o-mean"

    def decode_rule(self):
        return replace(super().decode_rule(), rank="mean")  # h2o's fold (its decay), the mean's rank

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        # free slots may hold stale ordinals >= n_real: clamp, the core masks them out anyway
        return score / (n_real - ordinal).clamp(min=1)
