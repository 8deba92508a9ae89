"""``local``: a sliding window of the same total budget, the oldest token goes."""

import torch

from h2okv.policies.base import Budget, Policy


class LocalPolicy(Policy):
    name = "local"
    rank = "ordinal"

    def split(self, heavy, recent):
        return Budget(0, heavy + recent)

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return ordinal.to(torch.float32)
