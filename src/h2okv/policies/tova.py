"""``tova`` (Oren et al. 2024, "Transformers are Multi-State RNNs"): rank by the current query's attention.

The score of a slot is the probability mass the latest query (summed over the query heads that
share the KV head) gave it; older attention is forgotten. In a prefill chunk the latest query is
each row's last real token of the chunk. The recent window and the budget split are the core's,
as for every policy.
"""

from dataclasses import dataclass

from h2okv.policies.base import Policy, ScoreRule, heads_option


@dataclass(eq=False)
class TOVAPolicy(Policy):
    name = "tova"
    needs_scores = True
    score_queries = "last"
    heads: str = heads_option()

    def decode_rule(self):
        return ScoreRule(fold="replace", rank="score")

    def accumulate(self, score, mass):
        score.copy_(mass)  # last step only

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return score
