"""``random``: a random non-recent token goes (a control: what does *choosing* buy?). Seeded."""

import torch

from h2okv.policies.base import Policy


class RandomPolicy(Policy):
    name = "random"
    scan_safe = False  # its draws follow the buffer's shape: keep the slot-by-slot path

    def __post_init__(self):
        super().__post_init__()
        self._generator: dict[tuple[torch.device, int], torch.Generator] = {}

    def decode_rule(self):
        return None  # a seeded draw per layer: no kernel knows it, the tensor-op step runs it

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        # one stream per layer: the draws of a layer do not depend on how the forward calls
        # interleave layers (one pass over a whole text == a token-by-token loop)
        gen = self._generator.get((score.device, layer_idx))
        if gen is None:
            gen = torch.Generator(device=score.device)
            gen.manual_seed(self.seed * 1_000_003 + layer_idx)
            self._generator[(score.device, layer_idx)] = gen
        return torch.rand(score.shape, generator=gen, device=score.device)
