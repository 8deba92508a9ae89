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

import torch

from h2okv.policies.base import Policy


class KnormPolicy(Policy):
    name = "knorm"
    options = {"heads": str}

    def key_scores(self, keys):
        return -torch.linalg.vector_norm(keys.float(), dim=-1)

    def eviction_key(self, score, ordinal, n_real, layer_idx=0):
        return score
