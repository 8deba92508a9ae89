"""``slot_attention`` with mass on CUDA through Triton (``triton_kernels.py``): launch and shapes.

``slot_attention`` (``attention.py``) calls ``triton_slot_attention`` when ``kernels.triton_on``
says so; the eager path stays the fallback and the reference the tests hold these kernels to.
A decode step (one query per row, a mask that is per slot) is one launch of
``decode_mass_kernel``; a chunk is ``chunk_lse_kernel`` (output + log-sum-exp per query row)
then ``column_mass_kernel`` (each key's mass from the log-sum-exp, no probability matrix).
"""

from __future__ import annotations

from functools import cache

import torch

BLOCK_N = 64
BLOCK_M = 32


@cache
def _import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install that fails while importing
        return f"triton cannot be imported ({type(exc).__name__}: {exc})"
    return None


def triton_available() -> bool:
    return _import_error() is None


def triton_import_error() -> str | None:
    return _import_error()


def _kernels():
    from h2okv.core import triton_kernels

    return triton_kernels


def _block(n: int) -> int:
    """Power-of-two tile width for a dimension of ``n`` (>= 16: ``tl.dot``'s smallest)."""
    return max(16, 1 << max(0, n - 1).bit_length())


def decode_attention(query, keys, values, valid, scaling: float, weight=None):
    """``query [B, Hq, 1, D]``, ``keys/values [B, Hkv, cap, D/Dv]``, ``valid [B, Hkv, cap]`` bool or
    None, ``weight [B]`` or None -> ``(out [B, Hq, 1, Dv], mass [B, Hkv, cap] float32)``."""
    b, hq, _, d = query.shape
    hkv, cap, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    g = hq // hkv
    q = query.reshape(b, hq, d).contiguous()
    keys, values = _rows_contiguous(keys), _rows_contiguous(values)
    out = torch.empty((b, hq, dv), dtype=values.dtype, device=query.device)
    mass = torch.empty((b, hkv, cap), dtype=torch.float32, device=query.device)
    mask = _rows_contiguous(valid) if valid is not None else mass  # a dummy pointer when there is no mask
    w = weight if weight is not None else mass
    _kernels().decode_mass_kernel[(b * hkv,)](
        q, keys, values, mask, w, out, mass,
        q.stride(0), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
        values.stride(2), mask.stride(0), mask.stride(1), w.stride(0), out.stride(0), mass.stride(0), mass.stride(1),
        hkv, g, cap, d, dv, scaling,
        HAS_MASK=valid is not None, HAS_WEIGHT=weight is not None, IEEE=query.dtype == torch.float32,
        BLOCK_G=_block(g), BLOCK_N=BLOCK_N, BLOCK_D=_block(d), BLOCK_DV=_block(dv),
    )
    return out.reshape(b, hq, 1, dv), mass


def chunk_attention(query, keys, values, allowed, scaling: float, weight=None):
    """``query [B, Hq, m, D]``, ``allowed`` broadcastable to ``[B, Hkv, m, cap]`` or None, ``weight
    [B, m]`` or None -> ``(out [B, Hq, m, Dv], mass [B, Hkv, cap] float32)``: output and
    log-sum-exp first, then the column sums."""
    b, hq, m, d = query.shape
    hkv, cap, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    rows = (hq // hkv) * m
    q = query.contiguous().reshape(b, hkv, rows, d)
    keys, values = _rows_contiguous(keys), _rows_contiguous(values)
    out = torch.empty((b, hkv, rows, dv), dtype=values.dtype, device=query.device)
    lse = torch.empty((b, hkv, rows), dtype=torch.float32, device=query.device)
    mass = torch.empty((b, hkv, cap), dtype=torch.float32, device=query.device)
    mask = allowed.expand(b, hkv, m, cap) if allowed is not None else mass[:, :, None, :]
    w = weight.contiguous() if weight is not None else lse
    k = _kernels()
    common = dict(HAS_MASK=allowed is not None, IEEE=query.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                  BLOCK_D=_block(d))
    k.chunk_lse_kernel[(b * hkv, -(-rows // BLOCK_M))](
        q, keys, values, mask, out, lse,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), *mask.stride(),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
        hkv, rows, m, cap, d, dv, scaling, BLOCK_DV=_block(dv), **common,
    )
    k.column_mass_kernel[(b * hkv, -(-cap // BLOCK_N))](
        q, keys, mask, lse, w, mass,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        *mask.stride(), lse.stride(0), lse.stride(1), w.stride(0), mass.stride(0), mass.stride(1),
        hkv, rows, m, cap, d, scaling, HAS_WEIGHT=weight is not None, **common,
    )
    return out.reshape(b, hq, m, dv), mass


def triton_slot_attention(query, keys, values, allowed, scaling: float, query_weight=None):
    """``slot_attention(..., need_mass=True)`` through the kernels (same arguments and results)."""
    b, _, m, _ = query.shape
    hkv, cap = keys.shape[1], keys.shape[2]
    if m == 1 and (allowed is None or allowed.shape[-2] == 1):
        valid = None if allowed is None else allowed.expand(b, hkv, 1, cap)[:, :, 0, :]
        weight = None if query_weight is None else query_weight[:, 0]
        return decode_attention(query, keys, values, valid, scaling, weight)
    return chunk_attention(query, keys, values, allowed, scaling, query_weight)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dimension with stride 1; slot buffers already are."""
    return t if t.stride(-1) == 1 else t.contiguous()

