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

from dataclasses import dataclass

from h2okv.policies.base import Policy, ScoreRule, heads_option, option


def decay_option():
    """``decay``: how the score keeps older mass, 1 all of it (the sum), below 1 a geometric window
    (a field of ``h2o`` and of the policies that decode as it and take the option)."""
    return option(1.0, check=lambda v: 0.0 < v <= 1.0, must_be="in (0, 1]", shown=False)


class HeavyHitters(Policy):
    """h2o's hooks without its options: the base of ``h2o`` and of the policies that decode as it
    (``snapkv``, ``rkv``, ``expected``, ``kvzip``), each a dataclass declaring its own options in the
    order its spec writes them (a dataclass puts inherited fields first)."""

    needs_scores = True
    decay = 1.0  # a policy without the ``decay`` option keeps the sum

    def decode_rule(self):
        # below 1 the score fades first: "decay", which only the C and Triton decode steps know
        return ScoreRule(fold="decay" if self.decay < 1.0 else "add", rank="score", decay=self.decay)

    def accumulate(self, score, mass):
        if self.decay < 1.0:
            score.mul_(self.decay)
        score.add_(mass)

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return score


@dataclass(eq=False)
class H2OPolicy(HeavyHitters):
    name = "h2o"
    decay: float = decay_option()
    heads: str = heads_option()
