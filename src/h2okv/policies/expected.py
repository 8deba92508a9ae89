"""``expected`` (Devoto et al. 2025, "Expected Attention"; kvpress's ``ExpectedAttentionPress``):
rank a prompt's tokens by the attention future queries are expected to pay them.

No question is needed: the prompt's own queries are taken as a sample of the queries to come.
Their mean ``mu`` and covariance ``S`` (per query head) are moved to the next ``future``
positions and averaged over them (RoPE turns a query with its position; ``R`` below is the mean of
those turns). If the next query is Gaussian with that mean and covariance, its expected
exponentiated logit on a key ``k`` is ``exp(s mu'.k + s^2 k'S'k / 2)`` (``s``: the attention
scale; ``mu' = R mu``, ``S' = R S R^T``). Normalised over the keys, averaged over the query heads of
a KV head, and multiplied by ``||v||`` (a token with a small value changes little), that is each
token's score. The first ``sinks`` tokens of a sequence are left out of the statistics and kept
(attention sinks), as kvpress does.

The queries the core hands over are already rotated to their own positions, so each is first
turned back to the call's last real position (``RopeRotation.rotate_`` by the difference); the
statistics are then those of queries at one position, and the future turns are relative to it.
A model without RoPE has no turn (``R`` is the identity).

Like ``snapkv`` these scores rank a multi-token forward call before it is chunked (so bounded
chunked prefill keeps what one ranking after the whole call would keep), and decode steps then
add their attention mass as in ``h2o``. ``chunk_size=1`` (token-by-token scoring) has no prompt
to rank: ``expected`` is ``h2o`` there. Question-agnostic by construction: in a question-agnostic
evaluation the question arrives after the ranking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from h2okv.errors import H2OError
from h2okv.policies.base import heads_option, option
from h2okv.policies.h2o import HeavyHitters


@dataclass(eq=False)
class ExpectedAttentionPolicy(HeavyHitters):
    name = "expected"
    ranks_upfront = True
    future: int = option(512, check=lambda v: v >= 1, must_be=">= 1")
    sinks: int = option(4, check=lambda v: v >= 0, must_be=">= 0")
    heads: str = heads_option()

    def __post_init__(self):
        super().__post_init__()
        self.rope = None  # the model's RoPE, set by ``bind``
        self._mean_turn = None  # (rope, cos, sin): RoPE's rotation averaged over the future

    @property
    def sink_tokens(self) -> int:
        return self.sinks  # the core protects ``sink_tokens``; the spec calls them ``sinks``

    def bind(self, model) -> None:
        from h2okv.core.rope import RopeRotation, rotary_module

        if rotary_module(model) is None:
            self.rope = None  # absolute or no positions: a future query is not turned
            return
        try:
            self.rope = RopeRotation.from_model(model, partial_ok=True)
        except H2OError as exc:
            raise H2OError(f"policy 'expected' cannot move queries along positions: {exc}") from None

    def prefill_scores(self, query, key_new, old_keys, old_valid, new_real, scaling, value_new=None, old_values=None,
                       old_in_order=None):
        """``(old [B, Hkv, cap], new [B, Hkv, n])``: each live slot's and new token's expected
        attention times its value norm (zero for dead slots and pads)."""
        b, hq, n, d = query.shape
        hkv, cap = key_new.shape[1], old_keys.shape[2]
        device = query.device
        index = torch.arange(n, device=device)
        real = index < new_real[:, None]  # [B, n]: real tokens come first in a row
        starts = ~old_valid.flatten(1).any(-1)  # [B]: the call opens its sequence
        sample = real & ~(starts[:, None] & (index < self.sink_tokens))
        sample = torch.where(sample.any(-1, keepdim=True), sample, real)  # a call of sinks only

        q = query.float().clone()
        if self.rope is not None:  # every query turned to its row's last real position
            behind = (new_real[:, None] - 1 - index).clamp(min=0)
            self.rope.rotate_(q, behind[:, None, :].expand(b, hq, n))
        weight = sample.float()[:, None, :, None]
        count = sample.sum(-1).clamp(min=1).float()[:, None, None]  # [B, 1, 1]
        mu = (q * weight).sum(2) / count  # [B, Hq, D]
        centered = (q - mu[:, :, None]) * weight
        cov = centered.transpose(-1, -2) @ centered / count[..., None]  # [B, Hq, D, D]
        mu, cov = self._turn(mu), self._turn(self._turn(cov).transpose(-1, -2)).transpose(-1, -2)

        keys = torch.cat([old_keys, key_new], dim=2).float()  # [B, Hkv, cap + n, D]
        g = hq // hkv
        mu, cov = mu.view(b, hkv, g, 1, d), cov.view(b, hkv, g, d, d)
        k = keys[:, :, None]  # [B, Hkv, 1, T, D]
        logits = scaling * (k * mu).sum(-1) + 0.5 * scaling**2 * ((k @ cov) * k).sum(-1)  # [B, Hkv, g, T]
        live = torch.cat([old_valid, real[:, None].expand(b, hkv, n)], dim=-1)
        logits.masked_fill_(~live[:, :, None], float("-inf"))
        scores = torch.softmax(logits, dim=-1).nan_to_num_(0.0).mean(2)  # [B, Hkv, T]
        if value_new is not None and old_values is not None:
            scores = scores * torch.cat([old_values, value_new], dim=2).float().norm(dim=-1)
        return scores[..., :cap], scores[..., cap:]

    def _turn(self, x: torch.Tensor) -> torch.Tensor:
        """``R x`` along the last dimension: each (i, i + D/2) pair turned by the mean over the next
        ``future`` positions of RoPE's rotation (a shrinking rotation: the turns partly cancel)."""
        if self.rope is None:
            return x
        if self._mean_turn is None or self._mean_turn[0] is not self.rope:  # once per RoPE, not per call
            steps = torch.arange(1, self.future + 1, dtype=torch.float64)
            angle = steps[:, None] * self.rope.inv_freq.cpu()[None]  # [future, D/2]
            self._mean_turn = (self.rope, angle.cos().mean(0).float(), angle.sin().mean(0).float())
        cos, sin = (t.to(x.device) for t in self._mean_turn[1:])
        half, rot = self.rope.rotary_dim // 2, self.rope.rotary_dim
        first, second = x[..., :half], x[..., half:rot]
        return torch.cat([first * cos - second * sin, second * cos + first * sin, x[..., rot:]], dim=-1)
