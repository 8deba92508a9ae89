"""``local``: a sliding window of the same total budget, the oldest token goes."""

import torch

from h2okv.policies.base import Budget, Policy, ScoreRule


class LocalPolicy(Policy):
    name = "local"

    def decode_rule(self):
        return ScoreRule(fold=None, rank="ordinal")  # no attention mass: the oldest goes

    def split(self, heavy, recent):
        return Budget(0, heavy + recent)

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return ordinal.to(torch.float32)
