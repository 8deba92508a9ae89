"""Tensors into the C kernels: checks of what they assume (float32, contiguous rows), pointers out."""

from __future__ import annotations

import torch

from h2okv.core.native.build import library
from h2okv.core.native.rules import native_rule


def scan_rule(policy, probs: torch.Tensor, state) -> tuple[int, int] | None:
    """The native rule for this scan call, or None when it must run eager."""
    if probs.dtype != torch.float32 or not probs.is_contiguous():
        return None
    rows = (state.bias, state.blocked, state.score, state.ordinal)
    stride = state.bias.stride()
    if any(t.stride() != stride for t in rows) or stride[-1] != 1 or stride[0] != stride[1] * state.bias.shape[1]:
        return None
    return native_rule(policy)


def scan_block(probs: torch.Tensor, state, plan, start: int, policy, rule: tuple[int, int]) -> None:
    """``scan.scan_block`` in C: same arguments, same effect (tested against it)."""
    b, hkv, g, blk, width = probs.shape
    acc, key = rule
    mass = torch.empty(width, dtype=torch.float32)  # scratch; held here for the call's duration
    library().scan_block(
        probs.data_ptr(), state.bias.data_ptr(), state.blocked.data_ptr(), state.score.data_ptr(),
        state.ordinal.data_ptr(), b * hkv, g, blk, width, state.bias.stride(1),
        plan.first_new, plan.n0, plan.recent, plan.evict_from, start, acc, key, int(policy.evicts),
        mass.data_ptr(),
    )


def decode_rule(layer, query=None) -> tuple[int, int] | None:
    """The native rule for a dense (or flat: ``layer.ragged``) decode step of ``layer``, or None
    when it must run eager (``query`` None: asked before the step, of the layer alone)."""
    held = layer.ragged if layer.ragged is not None else layer  # never unflattens the layer
    keys, values = held.keys, held.values
    if keys.dtype != torch.float32 or (query is not None and query.dtype != torch.float32):
        return None
    if not (keys.is_contiguous() and values.is_contiguous() and layer.n_real.is_contiguous()):
        return None
    return native_rule(layer.owner.policy)


def decode_dense(layer, fast, query, k_new, v_new, scaling: float, rule: tuple[int, int]) -> torch.Tensor:
    """``step.decode_step`` for a dense buffer, packed heads of uneven budgets (``fast.widths``) or
    a flattened layer (``layer.ragged``: each head's own slots only), in C; returns ``[B, 1, Hq, Dv]``."""
    ragged = layer.ragged
    held = ragged if ragged is not None else layer
    b, hkv, cap = ragged.shape if ragged is not None else layer.keys.shape[:3]
    hq, dv = query.shape[1], held.values.shape[-1]
    d = held.keys.shape[-1]
    slot = fast.next_free
    if slot is None:  # the first step after the budget was reached: the first free slot
        slot = layer.valid.view(torch.uint8).argmin(dim=-1, keepdim=True)
    query, k_new, v_new = query.contiguous(), k_new.contiguous(), v_new.contiguous()
    out = torch.empty((b, 1, hq, dv), dtype=torch.float32)
    acc, key = rule
    probs = torch.empty((hq // hkv) * cap, dtype=torch.float32)  # scratch; held for the call
    library().decode_dense(
        query.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), held.keys.data_ptr(), held.values.data_ptr(),
        held.score.data_ptr(), held.ordinal.data_ptr(), held.valid.data_ptr(), slot.data_ptr(),
        layer.n_real.data_ptr(), fast.recent_start.data_ptr(),
        None if fast.sinks is None else fast.sinks.data_ptr(),
        None if fast.widths is None else fast.widths.data_ptr(),
        None if ragged is None else ragged.base.data_ptr(), out.data_ptr(),
        b * hkv, hkv, hq // hkv, cap, d, dv, scaling, acc, key, probs.data_ptr(),
    )
    fast.next_free = slot  # the kernel wrote each row's victim there
    return out
