"""``rkv``: redundancy-aware heavy hitters, after R-KV (Cai et al. 2025, arXiv 2505.24133).

A long reasoning trace says the same thing many times, and the tokens that repeat draw attention
as a heavy hitter does: ``h2o`` keeps every copy. R-KV ranks a token by its importance *and* by how
alike its key is to the other keys kept, so that of several copies some go and a distinct token
of the same importance stays. Our rule, per (row, KV head), over the live slots only (free slots
and pads are never live):

- importance: the accumulated attention mass exactly as ``h2o`` keeps it (``accumulate``
  unchanged), normalised over the live slots: ``I_i = score_i / sum(score)`` (0 when the sum is 0);
- redundancy: ``r_i`` = the mean cosine similarity of slot ``i``'s key to the *other* live keys
  (itself excluded; 0 when it is the only one), and ``R = softmax(r)`` over the live slots;
- eviction key: ``weight * I - (1 - weight) * R``, the lowest candidate evicted first. Option
  ``weight`` in [0, 1] (R-KV's lambda, default 0.1): ``rkv:weight=1`` ranks as ``h2o``,
  ``rkv:weight=0`` by redundancy alone. ``decay`` as ``h2o``'s: with it below 1 the importance is
  what the latest queries read, as R-KV takes it from its last few queries. ``kernel=K`` (odd,
  default 1: none) smooths the importance as R-KV does, by the largest ``I`` among the ``K``
  nearest live slots in token order (a slot between kept neighbours ranks with them, so a number
  of several digit tokens is kept or dropped whole); the C step does not know it.
- ``copies=T`` (in [0, 1), default 0: off), R-KV's "retain the last": a live key whose cosine to
  key ``i`` is above ``T`` is a copy of ``i``, and the latest of ``i``'s copies (the largest
  ordinal) does not count ``cos(i, latest)`` in its redundancy. Of a run of alike keys every copy
  stays redundant but the newest, so a thought restated keeps its latest statement rather than
  losing every copy together. It needs the ``[cap, cap]`` cosines (O(slots^2 x head_dim)); the C
  step and Triton do not know it.

Because a token's key depends on every token kept, one eviction ranks once and frees the lowest of
that ranking (a chunk's excess together, as R-KV selects its kept set); ``core/reference.py`` does
the same. Keys are taken as stored (after RoPE), in float32 (the reference's float64), per KV
head: K is never expanded to the query heads. ``sum_j cos(k_i, k_j)`` is ``u_i . sum_j u_j`` with
``u`` the unit keys, so the key costs two matrix-vector products, O(slots x head_dim), not
O(slots^2), and a free slot's key (weighted 0) takes no part in any sum. The rank is declared
("rkv"): the C decode step at the budget computes it in the same two passes
(``core/native/kernels.c``: ``rkv_ranks``); the per-token scan and Triton do not know it and run
the tensor-op steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from h2okv.policies.base import heads_option, option
from h2okv.policies.h2o import HeavyHitters, decay_option

NORM_EPS = 1e-12  # a zero key has no direction: its unit key is zero, alike to nothing


@dataclass(eq=False)
class RKVPolicy(HeavyHitters):
    name = "rkv"
    ranks_by_keys = True
    # The per-token scan (core/scan.py) ranks in its own layout (old slots, then the call's
    # tokens), which is safe for a key that depends only on its arguments. This one does: the live
    # set (``valid``), its scores and its keys, summed over that set whatever the slots' order, and
    # not on the calls before or the buffer's shape. The scan hands it its keys and live set
    # (bias 0), so it stays True.
    scan_safe = True
    # R-KV's lambda: the importance's share of the key
    weight: float = option(0.1, check=lambda v: 0.0 <= v <= 1.0, must_be="in [0, 1]")
    # importance from the latest queries (h2o.py), as R-KV's observation window takes it
    decay: float = decay_option()
    # R-KV's max pooling of the importance over neighbouring kept tokens (1: none)
    kernel: int = option(1, check=lambda v: v >= 1 and v % 2 == 1, must_be="an odd number >= 1", shown=False)
    # R-KV's threshold (0.5) for "alike": each key's latest copy is spared (0: off)
    copies: float = option(0.0, check=lambda v: 0.0 <= v < 1.0, must_be="in [0, 1)", shown=False)
    heads: str = heads_option()

    def decode_rule(self):
        """h2o's fold (its decay) and the rank "rkv", which the C and Triton decode steps compute
        (core/native/rules.py); with ``kernel`` or ``copies`` the key also reads the slots' token
        order (pooling, the latest copy), which they do not: the tensor-op step."""
        if self.kernel > 1 or self.copies > 0:
            return None
        return replace(super().decode_rule(), rank="rkv", weight=self.weight)

    def eviction_key(self, score, ordinal, n_real, layer_idx=0, *, keys=None, valid=None):
        """``weight * I - (1 - weight) * R`` of every slot ``[..., cap]`` (see the module docstring);
        ``keys`` ``[..., cap, D]`` and the live slots ``valid`` ``[..., cap]`` are required. Slots
        that are not live get 0 (the core shields them)."""
        if keys is None or valid is None:
            raise ValueError("rkv ranks with the layer's keys: eviction_key needs keys= and valid=")
        dtype = torch.promote_types(score.dtype, torch.float32)  # float32, float64 in the reference
        live = valid.to(torch.bool)
        importance = self.importance(score.to(dtype), live)
        if self.kernel > 1:
            importance = pool_neighbours(importance, ordinal, live, self.kernel)
        redundancy = self.redundancy(keys.to(dtype), live, ordinal, self.copies)
        key = self.weight * importance - (1.0 - self.weight) * redundancy
        return key.masked_fill(~live, 0.0)

    @staticmethod
    def importance(score, live):
        """``I``: each live slot's share of the live slots' score (0 where the sum is 0)."""
        mass = score.masked_fill(~live, 0.0)
        total = mass.sum(-1, keepdim=True)
        return mass / total.clamp(min=torch.finfo(mass.dtype).tiny)

    @staticmethod
    def redundancy(keys, live, ordinal=None, copies: float = 0.0):
        """``R``: the softmax over the live slots of each one's mean cosine similarity to the
        other live keys of its (row, head); 0 where not live. With ``copies`` > 0 (and the slots'
        ``ordinal``), the cosines that make a slot some key's latest copy are left out of its sum.

        In matrix products, no ``[cap, D]`` temporary: a slot's unit key is ``k_i / |k_i|``, and
        a slot that is not live weighs 0, so its stale key (finite: buffers start at zero and
        hold only written keys) enters no sum."""
        norm = torch.linalg.vector_norm(keys, dim=-1)  # [..., cap]
        inverse = torch.where(live, 1.0 / norm.clamp(min=NORM_EPS), 0.0)
        together = (inverse.unsqueeze(-2) @ keys).transpose(-1, -2)  # [..., D, 1]: sum of live unit keys
        # sum over the other live keys j != i of cos(k_i, k_j) = u_i . (sum_j u_j) - u_i . u_i
        others = (keys @ together).squeeze(-1) * inverse - (norm * inverse).square()
        if copies > 0:
            others = others - latest_copy_cosines(keys * inverse.unsqueeze(-1), live, ordinal, copies)
        count = live.sum(-1, keepdim=True)
        mean = others / (count - 1).clamp(min=1).to(others.dtype)
        weights = torch.softmax(mean.masked_fill(~live, -torch.inf), dim=-1)
        return torch.where(live, weights, 0.0)  # a (row, head) with no live slot: NaN -> 0


def pool_neighbours(values, ordinal, live, kernel: int):
    """Each live slot's largest value among the ``kernel`` live slots nearest it in token order
    (itself in the middle; fewer at either end); 0 where not live. ``ordinal`` broadcasts against
    ``values`` ``[..., cap]``."""
    ordinal = ordinal.expand_as(values)
    # live slots in token order first, the rest after them (never a live slot's neighbour: -inf)
    order = ordinal.masked_fill(~live, torch.iinfo(ordinal.dtype).max).argsort(dim=-1, stable=True)
    ranked = values.gather(-1, order).masked_fill(~live.gather(-1, order), -torch.inf)
    shape = ranked.shape
    pooled = torch.nn.functional.max_pool1d(ranked.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2)
    out = torch.empty_like(values).scatter_(-1, order, pooled.reshape(shape))
    return out.masked_fill(~live, 0.0)


def latest_copy_cosines(unit, live, ordinal, threshold: float):
    """For each live slot ``j``, the sum of ``cos(i, j)`` over the live keys ``i`` whose latest
    copy ``j`` is (the live ``j != i`` of the largest ordinal with ``cos(i, j) > threshold``);
    ``unit`` ``[..., cap, D]`` holds the unit keys (zero where not live)."""
    cos = unit @ unit.transpose(-1, -2)  # [..., i, j]
    cap = cos.shape[-1]
    alike = (cos > threshold) & live.unsqueeze(-1) & live.unsqueeze(-2)
    alike &= ~torch.eye(cap, dtype=torch.bool, device=cos.device)
    order = ordinal.expand_as(live).unsqueeze(-2).expand_as(alike)
    latest = torch.where(alike, order, -1).argmax(-1, keepdim=True)  # [..., i, 1]: the slot j
    spared = cos.gather(-1, latest).squeeze(-1) * alike.any(-1)  # cos(i, latest(i)), 0 without a copy
    return torch.zeros_like(spared).scatter_add_(-1, latest.squeeze(-1), spared)
