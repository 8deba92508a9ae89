"""Head-adaptive budgets (Ada-KV, Feng et al. 2024): a layer's heavy slots shared out among its KV heads.

A uniform budget gives every KV head of a layer the same ``heavy`` slots. Attention is not spread
alike over heads: some heads look at a few tokens, others at many, so a head that needs little
wastes slots another head would use. Ada-KV ranks the candidates of all heads of a layer
together and gives each head as many slots as it has among the layer's best, keeping the layer's
total. A floor (Ada-KV's safeguard) first gives each head its own best ``floor`` share of a
uniform head's choice, so that no head starves.

The core calls ``allocate`` when a forward call has been ranked whole: at the end of a late
prefill, or before the first chunk when the policy ranks the whole call up front (``snapkv``'s
look-ahead, ``knorm``'s key norms). Each head then holds its own ``heavy_h + recent`` slots until
the next such call; decode steps evict one token per head as usual. What is allocated is one
``[B, H, cap]`` buffer per layer, so a layer's capacity is its largest head budget: the KV bytes
the cache reports are those slots (``H2OCache.stats``), more than the uniform budget's when the
heads are uneven.

``layers`` goes one step further, as KVzip does: the whole cache's heavy slots are shared among
every (layer, KV head) at once, so a layer that needs little gives slots to one that needs many.
Only a ranking of every layer at the same moment can do that: the reconstruction pass
(``h2okv.reconstruct``, policy ``kvzip``) is the one that has it.

A ceiling (``kvzip:ceiling=C``) is the floor's mirror: no head takes more than its own best ``C``
times a uniform head's choice. Shared out whole by reconstruction, a head that copies the prompt
(each token in turn at probability ~1) ranks every token high and keeps nearly all of them (the
0.5B at 6k, 20%: two heads of layer 16 held 6,087 and 6,003 of 6,144 tokens, 48 heads in all),
while many others keep their sinks and recent window only.
"""

from __future__ import annotations

import math

import torch


def head_places(value: torch.Tensor) -> torch.Tensor:
    """``[B, H, N]``: each slot's place in its own head's order of ``value`` ``[B, H, N]``, best
    first (0); ties go to the lower slot. ``place < k`` marks a head's best ``k``."""
    order = value.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(value.shape[-1], device=value.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ranks)


def allocate(key: torch.Tensor, candidate: torch.Tensor, heavy: torch.Tensor, sinks: torch.Tensor,
             floor: float, ceiling: float = 0.0) -> torch.Tensor:
    """Heavy slots per (row, head) ``[B, H]``; every row's sum is ``H * heavy``.

    ``key`` ``[B, H, N]``: the policy's rank of each token (higher is kept first); ``candidate``
    ``[B, H, N]``: the tokens the policy may choose from (live, outside the recent window and the
    sinks); ``heavy``, ``sinks`` ``[B]``: the row's uniform heavy part and its protected first
    tokens, which every head keeps. A head's choice is then ``heavy_h - sinks`` of its candidates:
    first its own best ``floor * (heavy - sinks)``, then the layer's best of what is left, up to
    ``H * (heavy - sinks)`` in all, no head past its own best ``ceil(ceiling * (heavy - sinks))``
    (``ceiling`` >= 1; 0: no ceiling). Slots left when the candidates are fewer are shared evenly.
    Ties go to the lower head, then the lower slot.
    """
    b, h, n = key.shape
    device = key.device
    choice = (heavy - sinks).clamp(min=0)  # [B] a uniform head's choice
    total = h * choice
    floor_n = (choice.float() * floor).floor().long()
    value = key.float().masked_fill(~candidate, -math.inf)

    # each head's own best floor_n candidates
    place = head_places(value)
    floored = candidate & (place < floor_n[:, None, None])
    picks = floored.sum(-1)  # [B, H]
    if ceiling:  # past a head's own best ceil_n, its candidates are no candidates
        ceil_n = (choice.float() * ceiling).ceil().long()
        value = value.masked_fill(place >= ceil_n[:, None, None], -math.inf)

    # the rest: the layer's best candidates not yet chosen, until the total is reached
    rest = value.masked_fill(floored, -math.inf).reshape(b, h * n)
    ranked = rest.argsort(dim=-1, descending=True, stable=True)
    wanted = (torch.minimum(total, candidate.sum((1, 2))) - picks.sum(-1)).clamp(min=0)  # [B]
    take = (torch.arange(h * n, device=device) < wanted[:, None]) & rest.gather(1, ranked).isfinite()
    picks = picks + torch.zeros_like(picks).scatter_add_(1, ranked // n, take.long())

    # fewer candidates than the total: every head keeps all of its own, the spare slots are spread
    spare = total - picks.sum(-1)
    even = spare[:, None] // h + (torch.arange(h, device=device) < (spare % h)[:, None]).long()
    return sinks[:, None] + picks + even


def allocate_layers(keys: list[torch.Tensor], candidates: list[torch.Tensor], heavy: torch.Tensor,
                    sinks: torch.Tensor, floor: float, ceiling: float = 0.0) -> list[torch.Tensor]:
    """``allocate`` over every (layer, head) at once: per layer ``[B, H]`` heavy slots, the rows'
    sum over all layers and heads being ``layers * H * heavy``. Layers of different capacities are
    padded with slots that are no candidate."""
    n = max(k.shape[-1] for k in keys)
    pad = [(k, c) if k.shape[-1] == n else (torch.nn.functional.pad(k.float(), (0, n - k.shape[-1])),
                                             torch.nn.functional.pad(c, (0, n - c.shape[-1])))
           for k, c in zip(keys, candidates, strict=True)]
    shares = allocate(torch.cat([k for k, _ in pad], 1), torch.cat([c for _, c in pad], 1), heavy, sinks, floor,
                      ceiling)
    return list(shares.split([k.shape[1] for k in keys], dim=1))
