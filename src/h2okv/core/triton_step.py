"""The whole at-budget decode step as one Triton launch on CUDA (``decode_step_kernel``).

On a GPU the decode step of a small model is bound by launching kernels, not by arithmetic: the
first lent H100 ran h2o's eager step (five scatters, attention, the mass, the rank, the argmin: ~18
launches a layer more than a plain cache) at 1.32-1.39x the step of a plain cache of its size.
This runs what ``step.decode_step`` does for a dense layer at its budget in one launch per layer,
plus two in-place adds (``n_real`` and the window advance once per sequence, not per head). It
knows the rules of the native C step (``native/rules.py``: add or replace the mass; rank by the
score, the score per query, or the ordinal) and nothing else: any other policy stays eager.
"""

from __future__ import annotations

import torch

from h2okv.core.native.rules import native_rule
from h2okv.core.triton_attention import BLOCK_N, _block, _kernels


def decode_rule(layer) -> tuple[int, int] | None:
    """The rule to run ``layer``'s dense decode step with, or None when it must stay eager."""
    if not (layer.keys.stride(-1) == 1 and layer.values.stride(-1) == 1 and layer.score.is_contiguous()
            and layer.ordinal.is_contiguous() and layer.valid.is_contiguous() and layer.n_real.is_contiguous()):
        return None
    return native_rule(layer.owner.policy)


def decode_dense(layer, fast, query, k_new, v_new, scaling: float, rule: tuple[int, int]) -> torch.Tensor:
    """``step.decode_step`` for a dense layer at its budget; returns ``[B, 1, Hq, Dv]``."""
    b, hkv, cap, d = layer.keys.shape
    hq, dv = query.shape[1], layer.values.shape[-1]
    slot = fast.next_free
    if slot is None:  # the first step after the budget was reached: the first free slot
        slot = layer.valid.view(torch.uint8).argmin(dim=-1, keepdim=True)
    query, k_new, v_new = query.contiguous(), k_new.contiguous(), v_new.contiguous()
    slot = slot.contiguous()
    victim = torch.empty_like(slot)
    out = torch.empty((b, 1, hq, dv), dtype=layer.values.dtype, device=query.device)
    recent_start = fast.recent_start.reshape(b)
    sinks = fast.sinks.reshape(b) if fast.sinks is not None else recent_start  # a dummy pointer
    acc, key = rule
    keys, values = layer.keys, layer.values
    _kernels().decode_step_kernel[(b * hkv,)](
        query, k_new, v_new, keys, values, layer.score, layer.ordinal, layer.valid.view(torch.uint8), slot, victim,
        layer.n_real, recent_start, sinks, out,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        layer.score.stride(0), layer.score.stride(1),
        hkv, hq // hkv, cap, d, dv, scaling,
        ACC=acc, KEY=key, HAS_SINKS=fast.sinks is not None, IEEE=query.dtype == torch.float32,
        BLOCK_G=_block(hq // hkv), BLOCK_N=BLOCK_N, BLOCK_D=_block(d), BLOCK_DV=_block(dv),
    )
    layer.n_real += 1
    fast.recent_start += 1
    fast.next_free = victim
    return out
