"""``h2o``: heavy hitters, the non-recent token with the least accumulated attention goes (Algorithm 1).

``decay=γ`` (default 1: the paper's sum) multiplies every score by ``γ`` before each forward call
adds its mass, so a token ranks by the attention of the recent queries, about the last
``1 / (1 - γ)`` of them, rather than by everything since it was written: the decode-time form of
SnapKV's observation window (re-ranking by the latest queries; arXiv 2512.12008 finds it among
the strongest for reasoning). A decode step is one call, one token; a prompt read in one call
decays once. In long generation a token the reasoning no longer reads loses its rank and goes,
however much the first steps gave it. The C decode step knows this fold ("decay"); the per-token
scan (a decay per call, not per token) and Triton do not, and run the tensor-op step.
"""

from h2okv.policies.base import Option, Policy, ScoreRule

# how the score folds older mass: 1 keeps it all (the sum); below 1, a geometric window
DECAY = Option("decay", float, 1.0, lambda v: 0.0 < v <= 1.0, "in (0, 1]", shown=False)


class H2OPolicy(Policy):
    name = "h2o"
    needs_scores = True
    ranks_heads = True
    declared = (DECAY,)
    decay = 1.0  # subclasses that declare their own options and not this one keep the sum

    def decode_rule(self):
        # below 1 the score fades first: "decay", which only the C and Triton decode steps know
        return ScoreRule(fold="decay" if self.decay < 1.0 else "add", rank="score", decay=self.decay)

    def accumulate(self, score, mass):
        if self.decay < 1.0:
            score.mul_(self.decay)
        score.add_(mass)

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return score
