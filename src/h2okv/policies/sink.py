"""``sink`` (StreamingLLM): the first 4 tokens (attention sinks) plus a window of the most recent."""

import torch

from h2okv.policies.base import Budget, Policy, ScoreRule


class SinkPolicy(Policy):
    name = "sink"
    sink_tokens = 4

    def decode_rule(self):
        return ScoreRule(fold=None, rank="ordinal")  # no attention mass: the oldest goes

    def split(self, heavy, recent):
        total = heavy + recent
        sinks = min(self.sink_tokens, max(total - 1, 0))
        return Budget(sinks, total - sinks)  # the heavy part is exactly the protected sinks

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return ordinal.to(torch.float32)  # oldest outside the sinks goes
