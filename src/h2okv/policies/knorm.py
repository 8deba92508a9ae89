"""``knorm`` (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"; kvpress's ``KnormPress``): keep the keys with the lowest L2 norm.

Keys that attract attention tend to have a small norm, so the key alone ranks a token: its score
is ``-||k||``, fixed when the token is written (``key_scores``), and the highest-norm candidate
goes first. No attention is needed (fused SDPA everywhere), and the rank of a token never changes,
so evicting chunk by chunk keeps exactly the set one ranking after the whole prompt would keep:
for ``knorm`` bounded chunked prefill and late prefill decide alike (the attention outputs, and
through them the later layers' keys, still differ). Norms are taken after RoPE, which rotates
pairs of coordinates and so leaves them unchanged. Question-agnostic: the question plays no part.
"""

from dataclasses import dataclass

import torch

from h2okv.policies.base import Policy, ScoreRule, heads_option

NORM_MAX = 60000.0  # below float16's largest finite value


@dataclass(eq=False)
class KnormPolicy(Policy):
    name = "knorm"
    scores_keys = True
    heads: str = heads_option()

    def decode_rule(self):
        # the kernels start a slot at 0, not at its key's score: they never run it (``scores_keys``)
        return ScoreRule(fold=None, rank="score")

    def key_scores(self, keys):
        # Rounded to float16's 11 significant bits: the same token id at two positions has the
        # same first-layer key norm up to rounding noise (~1e-7), and a padded batch rounds a little
        # differently than the row alone. Coarser than that noise, the tie is exact in both, and
        # exact ties fall to the slot order, which a row keeps in a batch: batch == batch-of-one.
        norm = torch.linalg.vector_norm(keys.float(), dim=-1).clamp(max=NORM_MAX)
        return -norm.to(torch.float16).float()

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return score
