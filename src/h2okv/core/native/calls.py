"""Tensors into the C kernels: checks of what they assume (float32, contiguous rows), pointers out."""

from __future__ import annotations

import torch

from h2okv.core.native.build import library
from h2okv.core.native.rules import KEY_RKV, DecodeRule, c_decode_rule, native_rule
from h2okv.core.runtime import RUNTIME


def _kernels():
    """The built library (``RUNTIME``: one attribute read on a decode step, and ``reset`` clears
    it: a second cache of it here once outlived the reset)."""
    return RUNTIME.native_library if RUNTIME.native_build is not None else library()


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


def decode_rule(layer) -> DecodeRule | None:
    """The native rule for the at-budget decode steps of ``layer`` (dense or packed, not yet flat),
    or None when they must run eager. Asked once, when the layer's stepper is chosen
    (``core/decode.py``): the queries have the keys' dtype."""
    if layer.dtype != torch.float32:  # the model's dtype: a quantized layer's copy is dequantized to it
        return None
    if not (layer.keys.is_contiguous() and layer.values.is_contiguous() and layer.n_real.is_contiguous()):
        return None
    return c_decode_rule(layer.config.policy)


def decode_dense(layer, state, query, k_new, v_new, scaling: float, rule: DecodeRule) -> torch.Tensor:
    """``decode.EagerStep`` for a dense buffer, packed heads of uneven budgets (``state.widths``) or
    a flattened layer (``layer.ragged``: each head's own slots only), in C; returns ``[B, 1, Hq, Dv]``."""
    ragged = layer.ragged
    held = ragged if ragged is not None else layer
    b, hkv, cap = ragged.shape if ragged is not None else layer.keys.shape[:3]
    slot = state.next_free if ragged is not None else state.free_slot(layer.valid)
    keys, values = held.keys, held.values
    if layer.coding is not None:
        keys, values = layer.write_token_and_read(slot, k_new, v_new)
    hq, d, dv = query.shape[1], keys.shape[-1], values.shape[-1]
    query, k_new, v_new = query.contiguous(), k_new.contiguous(), v_new.contiguous()
    out = torch.empty((b, 1, hq, dv), dtype=torch.float32)
    probs = torch.empty((hq // hkv) * cap, dtype=torch.float32)  # scratch; held for the call
    # rkv's scratch: each slot's norm and inverse norm, the sum of unit keys, the keys' ranks
    work = torch.empty(3 * cap + d, dtype=torch.float32) if rule.key == KEY_RKV else None
    _kernels().decode_dense(
        query.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), keys.data_ptr(), values.data_ptr(),
        held.score.data_ptr(), held.ordinal.data_ptr(), held.valid.data_ptr(), slot.data_ptr(),
        layer.n_real.data_ptr(), state.recent_start.data_ptr(),
        None if state.sinks is None else state.sinks.data_ptr(),
        None if state.widths is None else state.widths.data_ptr(),
        None if ragged is None else ragged.base.data_ptr(), out.data_ptr(),
        b * hkv, hkv, hq // hkv, cap, d, dv, scaling, rule.acc, rule.key, rule.decay, rule.weight, probs.data_ptr(),
        None if work is None else work.data_ptr(),
    )
    state.next_free = slot  # the kernel wrote each row's victim there
    return out
