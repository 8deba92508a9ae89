"""The decode step as one Triton launch a layer on CUDA (``decode_step_kernel``).

On a GPU the decode step of a small model is bound by launching kernels and by host syncs, not by
arithmetic: on the first lent H100, h2o's eager step (five scatters, attention, the mass, the rank,
the argmin: ~18 launches a layer more than a plain cache) cost 1.32-1.39x the step of a plain
cache of its size, and while rows still filled up to their budget the eager step also counted
the live slots, a sync, in every layer. Here the step is one launch plus one or two in-place adds
(``n_real``, and at the budget the window, once per sequence rather than per head):
``decode_dense`` for a layer at its budget (the one free slot is known), ``decode_general`` for a
layer with free slots and one budget per row. It knows the rules of the native C decode step
(``native/rules.py``: add, replace or fade-and-add the mass; rank by the score, the score per
query, the ordinal, or ``rkv``'s key from the live keys) and nothing else: any other policy stays
eager. ``rkv`` costs three more passes over the layer's keys (its key needs the sums over every
live key first); on the third lease's H100 its eager step was ~2x h2o's fused one.
If the kernel cannot be compiled on this GPU (it was written after the only lease, tested under
Triton's interpreter), the first step says so in one warning and every later one runs eager.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from h2okv.core.native.rules import DecodeRule, c_decode_rule
from h2okv.core.runtime import RUNTIME
from h2okv.core.storage import first_free
from h2okv.core.triton_attention import BLOCK_N, _block, _kernels
from h2okv.errors import first_line


def decode_rule(layer, general: bool = False) -> DecodeRule | None:
    """The rule to run ``layer``'s decode step with, or None when it must stay eager (an unknown
    rule; for the ``general`` step also a budget per head, which it does not know). The kernel
    knows the C decode step's rules (``native/rules.py``: ``c_decode_rule``), decay and ``rkv``
    included."""
    rule = c_decode_rule(layer.config.policy) if RUNTIME.triton_step_failure is None and layer.has_budget else None
    if rule is None or (general and layer.head_heavy is not None):
        return None
    tensors = (layer.score, layer.ordinal, layer.valid, layer.n_real, layer.heavy, layer.recent, layer.sinks)
    if layer.keys.stride(-1) != 1 or layer.values.stride(-1) != 1 or not all(t.is_contiguous() for t in tensors):
        return None
    return rule


def decode_dense(layer, state, query, k_new, v_new, scaling: float, rule: DecodeRule) -> torch.Tensor | None:
    """``decode.EagerStep`` for a dense layer at its budget (``state``: ``decode.AtBudget``); returns
    ``[B, 1, Hq, Dv]``, or None (nothing written) when the kernel cannot run here: the caller then
    runs the eager step."""
    slot = state.free_slot(layer.valid).contiguous()
    victim = torch.empty_like(slot)
    b = slot.shape[0]
    recent_start = state.recent_start.reshape(b)
    sinks = state.sinks.reshape(b) if state.sinks is not None else recent_start  # a dummy pointer
    rows = _Rows(general=False, slot=slot, victim=victim, recent_start=recent_start, sinks=sinks,
                 has_sinks=state.sinks is not None)
    out = _launch(layer, query, k_new, v_new, scaling, rule, rows, slot)
    if out is not None:
        state.recent_start += 1
        state.next_free = victim
    return out


def decode_general(layer, query, k_new, v_new, scaling: float, rule: DecodeRule) -> torch.Tensor | None:
    """The decode step of a layer with free slots (rows still filling up to their budget, or a
    capacity above it), one budget per row: the first free slot takes the token, and a row loses
    a slot only when it is then over its budget. No device sync: no live-slot count
    (``decode.at_budget``) is needed. None as ``decode_dense``."""
    dummy = layer.n_real
    rows = _Rows(general=True, slot=dummy, victim=dummy, recent_start=dummy, sinks=layer.sinks, has_sinks=True)
    # the kernel takes each row's first free slot; a quantized layer writes the token's codes there first
    slot = first_free(layer.valid) if layer.coding is not None else None
    return _launch(layer, query, k_new, v_new, scaling, rule, rows, slot)


@dataclass(frozen=True)
class _Rows:
    """The per-row pointers a launch hands the kernel besides the layer's own: the dense step's
    free ``slot``, where it writes the ``victim`` (the next free slot) and the window's
    ``recent_start``; the ``general`` step finds its own slot and window, so these are then dummy
    pointers. ``sinks`` is read only with ``has_sinks`` (else a dummy pointer too)."""

    general: bool
    slot: torch.Tensor
    victim: torch.Tensor
    recent_start: torch.Tensor
    sinks: torch.Tensor
    has_sinks: bool


def _launch(layer, query, k_new, v_new, scaling, rule, rows: _Rows, slot=None):
    """``slot``: where a quantized layer's token goes (its codes written, the kernel run over the
    float copy: ``SlotStorage.write_token_and_read``)."""
    if RUNTIME.triton_step_failure is not None:  # another layer's launch failed here: every layer steps eager
        return None
    keys, values = layer.keys, layer.values
    if layer.coding is not None:
        keys, values = layer.write_token_and_read(slot, k_new, v_new)
    b, hkv, cap, d = keys.shape
    hq, dv = query.shape[1], values.shape[-1]
    query, k_new, v_new = query.contiguous(), k_new.contiguous(), v_new.contiguous()
    out = torch.empty((b, 1, hq, dv), dtype=values.dtype, device=query.device)
    try:  # a kernel that cannot compile (or get its resources) fails here, before it writes anything
        _kernels().decode_step_kernel[(b * hkv,)](
            query, k_new, v_new, keys, values, layer.score, layer.ordinal, layer.valid.view(torch.uint8), rows.slot,
            rows.victim, layer.n_real, rows.recent_start, rows.sinks, layer.heavy, layer.recent, out,
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            layer.score.stride(0), layer.score.stride(1),
            hkv, hq // hkv, cap, d, dv, scaling, rule.decay, rule.weight,
            GENERAL=rows.general, ACC=rule.acc, KEY=rule.key, HAS_SINKS=rows.has_sinks, IEEE=query.dtype == torch.float32,
            BLOCK_G=_block(hq // hkv), BLOCK_N=BLOCK_N, BLOCK_D=_block(d), BLOCK_DV=_block(dv),
        )
    except Exception as exc:  # noqa: BLE001 - whatever Triton raises, the eager step is the answer
        return _give_up(exc)
    layer.n_real += 1
    return out


def _give_up(exc: Exception) -> None:
    RUNTIME.triton_step_failure = f"{type(exc).__name__}: {first_line(exc)}"
    warnings.warn(f"h2okv: the fused Triton decode step cannot run here ({RUNTIME.triton_step_failure}); "
                  f"using the eager step",
                  stacklevel=3)
    return None
