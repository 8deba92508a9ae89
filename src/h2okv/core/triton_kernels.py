"""Triton kernels for attention that must return each key's probability mass (H2O's scores).

FlashAttention cannot hand back the probability matrix, and materialising it is what makes
mass-returning attention slow on a GPU. These kernels never store it:

1. ``chunk_lse_kernel``: fused attention over one block of packed query rows; writes the output
   and each row's log-sum-exp (online softmax over key blocks).
2. ``column_mass_kernel``: per block of keys, the mass ``sum_q w_q * exp(q.k * scale - lse_q)``
   over every query row, recomputing the logits instead of reading probabilities.
3. ``decode_mass_kernel``: both passes in one program per (sequence, KV head) for a decode step.

Grouped-query attention is packed as in ``slot_attention``: the ``g`` query heads of a KV head are
the rows ``gi * m + qi`` of one ``[g*m, D]`` block, so K/V are read once per KV head and never
expanded, and the column sum over those rows is the KV head's score. Masks are boolean
``allowed[b, h, qi, key]`` (any strides: a broadcast mask is passed with zero strides); query
weights (padded rows, "last query only" policies) scale each query's contribution to the mass.

Imported only when a kernel is launched (``triton_attention.py``); under ``TRITON_INTERPRET=1``
(set before this module is imported) the kernels run on CPU tensors, which is how the tests
hold them to the eager path.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scaled_dot(q, k, scaling, IEEE: tl.constexpr):
    """``q [M, D] @ k.T`` in float32, scaled (IEEE: full float32 products, not TF32)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s.to(tl.float32) * scaling


@triton.jit
def _logits(q, k_ptrs, key_ok, d_ok, scaling, IEEE: tl.constexpr):
    """``q [M, D] @ k.T`` scaled, -inf where ``key_ok`` is False; ``k_ptrs`` ``[N, D]``."""
    k = tl.load(k_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    return _scaled_dot(q, k, scaling, IEEE)


@triton.jit
def _online_step(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key block of the online softmax: rows whose keys so far are all masked stay at zero."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv.to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def chunk_lse_kernel(
    Q, K, V, ALLOWED, OUT, LSE,
    s_qb, s_qh, s_qr,  # packed queries [B, Hkv, g*m, D], last stride 1
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
    s_ab, s_ah, s_aq, s_an,  # allowed [B, Hkv, m, cap]
    s_ob, s_oh, s_or, s_lb, s_lh,
    hkv, rows, m, cap, d, dv, scaling,
    HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    bh = tl.program_id(0)
    b, h = bh // hkv, bh % hkv
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    od, odv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    row_ok, d_ok, dv_ok = r < rows, od < d, odv < dv
    q = tl.load(Q + b * s_qb + h * s_qh + r[:, None] * s_qr + od[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(0, cap, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = n < cap
        s = _logits(q, K + b * s_kb + h * s_kh + n[:, None] * s_kn + od[None, :], key_ok, d_ok, scaling, IEEE)
        ok = key_ok[None, :] & row_ok[:, None]
        if HAS_MASK:
            a = tl.load(ALLOWED + b * s_ab + h * s_ah + (r % m)[:, None] * s_aq + n[None, :] * s_an, mask=ok, other=0)
            ok = ok & (a != 0)
        s = tl.where(ok, s, float("-inf"))
        v = tl.load(V + b * s_vb + h * s_vh + n[:, None] * s_vn + odv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_step(s, v, m_i, l_i, acc, IEEE)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(OUT + b * s_ob + h * s_oh + r[:, None] * s_or + odv[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + b * s_lb + h * s_lh + r, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def column_mass_kernel(
    Q, K, ALLOWED, LSE, WEIGHT, MASS,
    s_qb, s_qh, s_qr, s_kb, s_kh, s_kn,
    s_ab, s_ah, s_aq, s_an, s_lb, s_lh, s_wb, s_mb, s_mh,
    hkv, rows, m, cap, d, scaling,
    HAS_MASK: tl.constexpr, HAS_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    b, h = bh // hkv, bh % hkv
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    od = tl.arange(0, BLOCK_D)
    key_ok, d_ok = n < cap, od < d
    k = tl.load(K + b * s_kb + h * s_kh + n[:, None] * s_kn + od[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    mass = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, rows, BLOCK_M):
        r = start + tl.arange(0, BLOCK_M)
        row_ok = r < rows
        q = tl.load(Q + b * s_qb + h * s_qh + r[:, None] * s_qr + od[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scaling
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scaling
        lse = tl.load(LSE + b * s_lb + h * s_lh + r, mask=row_ok, other=float("inf"))
        ok = row_ok[:, None] & key_ok[None, :] & (lse[:, None] != float("-inf"))
        if HAS_MASK:
            a = tl.load(ALLOWED + b * s_ab + h * s_ah + (r % m)[:, None] * s_aq + n[None, :] * s_an, mask=ok, other=0)
            ok = ok & (a != 0)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        if HAS_WEIGHT:
            w = tl.load(WEIGHT + b * s_wb + r % m, mask=row_ok, other=0).to(tl.float32)
            p = p * w[:, None]
        mass += tl.sum(p, 0)
    tl.store(MASS + b * s_mb + h * s_mh + n, mass, mask=key_ok)


@triton.jit
def decode_mass_kernel(
    Q, K, V, VALID, WEIGHT, OUT, MASS,
    s_qb, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ab, s_ah, s_wb, s_ob, s_mb, s_mh,
    hkv, g, cap, d, dv, scaling,
    HAS_MASK: tl.constexpr, HAS_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """One decode step for one (sequence, KV head): its ``g`` query heads against ``cap`` slots
    (``VALID`` marks the live ones); the output, then each slot's mass summed over the group."""
    bh = tl.program_id(0)
    b, h = bh // hkv, bh % hkv
    gi, od, odv = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    g_ok, d_ok, dv_ok = gi < g, od < d, odv < dv
    # queries [B, Hq, D] (one token): the group's heads are rows h*g .. h*g + g - 1
    q = tl.load(Q + b * s_qb + (h * g + gi)[:, None] * d + od[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_base, v_base = K + b * s_kb + h * s_kh, V + b * s_vb + h * s_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(0, cap, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = n < cap
        if HAS_MASK:
            key_ok = key_ok & (tl.load(VALID + b * s_ab + h * s_ah + n, mask=n < cap, other=0) != 0)
        s = _logits(q, k_base + n[:, None] * s_kn + od[None, :], key_ok, d_ok, scaling, IEEE)
        s = tl.where(key_ok[None, :] & g_ok[:, None], s, float("-inf"))
        v = tl.load(v_base + n[:, None] * s_vn + odv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_step(s, v, m_i, l_i, acc, IEEE)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(OUT + b * s_ob + (h * g + gi)[:, None] * dv + odv[None, :], (acc / l_safe[:, None]).to(OUT.dtype.element_ty),
             mask=g_ok[:, None] & dv_ok[None, :])
    lse = m_i + tl.log(l_safe)
    w = 1.0
    if HAS_WEIGHT:
        w = tl.load(WEIGHT + b * s_wb).to(tl.float32)
    for start in range(0, cap, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = n < cap
        if HAS_MASK:
            key_ok = key_ok & (tl.load(VALID + b * s_ab + h * s_ah + n, mask=n < cap, other=0) != 0)
        s = _logits(q, k_base + n[:, None] * s_kn + od[None, :], key_ok, d_ok, scaling, IEEE)
        ok = key_ok[None, :] & g_ok[:, None] & (lse[:, None] != float("-inf"))
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        tl.store(MASS + b * s_mb + h * s_mh + n, tl.sum(p, 0) * w, mask=n < cap)


@triton.jit
def _group_logits(q, k_base, s_kn, n, key_ok, od, d_ok, slot, k_new, scaling, IEEE: tl.constexpr):
    """Logits of the group's queries against the key block ``n``; the slot written this step is
    taken from ``k_new`` in registers (another thread of the program may not see its store yet)."""
    k = tl.load(k_base + n[:, None] * s_kn + od[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    k = tl.where((n == slot)[:, None], k_new[None, :], k)
    return _scaled_dot(q, k, scaling, IEEE)


@triton.jit
def _fold(sc, mass, decay, ACC: tl.constexpr):
    """The score after this step's mass: 1 add, 2 replace, 3 fade by ``decay`` then add (eager's
    ``mul_`` then ``add_``)."""
    if ACC == 1:
        sc = sc + mass
    elif ACC == 2:
        sc = mass
    else:
        sc = sc * decay + mass
    return sc


@triton.jit
def _live_block(VALID, row, n, cap, slot, GENERAL: tl.constexpr):
    """Which slots of the block ``n`` hold a token this step: every one below ``cap`` when dense;
    in the general layout the valid ones and the slot written now (its flag may not be visible)."""
    key_ok = n < cap
    if GENERAL:
        key_ok = key_ok & ((tl.load(VALID + row + n, mask=n < cap, other=0) != 0) | (n == slot))
    return key_ok


@triton.jit
def _folded_scores(q, k_base, s_kn, SCORE, row, n, key_ok, g_ok, od, d_ok, slot, k_new, lse, cap, scaling, decay,
                   ACC: tl.constexpr, IEEE: tl.constexpr):
    """The block's scores with this step's mass folded in (ACC 0: as stored); the slot written
    now starts from 0. The group's mass is summed first, then folded: eager's order."""
    sc = tl.load(SCORE + row + n, mask=n < cap, other=0.0)
    sc = tl.where(n == slot, 0.0, sc)
    if ACC != 0:
        s = _group_logits(q, k_base, s_kn, n, key_ok, od, d_ok, slot, k_new, scaling, IEEE)
        p = tl.where(key_ok[None, :] & g_ok[:, None], tl.exp(s - lse[:, None]), 0.0)
        sc = _fold(sc, tl.sum(p, 0), decay, ACC)
    return sc


@triton.jit
def _live_keys(k_base, s_kn, n, key_ok, od, d_ok, slot, k_new):
    """The key block ``n`` in float32 (the slot written this step from registers), its norms and
    inverse norms (0 for a slot that is not live: it enters no sum), as ``policies/rkv.py``."""
    k = tl.load(k_base + n[:, None] * s_kn + od[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    k = tl.where((n == slot)[:, None], k_new[None, :], k).to(tl.float32)
    norm = tl.sqrt(tl.sum(k * k, 1))
    inverse = tl.where(key_ok, 1.0 / tl.maximum(norm, 1e-12), 0.0)
    return k, norm, inverse


@triton.jit
def _rkv_similarity(k_base, s_kn, n, key_ok, od, d_ok, slot, k_new, together, others):
    """Each live key's mean cosine similarity to the other live keys, ``(k_i . sum_j u_j) / |k_i| -
    u_i . u_i`` over ``others`` (= live - 1, at least 1); -inf where not live (out of the softmax)."""
    k, norm, inverse = _live_keys(k_base, s_kn, n, key_ok, od, d_ok, slot, k_new)
    self_sim = norm * inverse
    r = (tl.sum(k * together[None, :], 1) * inverse - self_sim * self_sim) / others
    return tl.where(key_ok, r, float("-inf"))


@triton.jit
def _rkv_sums(q, k_base, s_kn, SCORE, VALID, row, slot, k_new, lse, n_live, cap, scaling, decay,
              od, d_ok, g_ok, GENERAL: tl.constexpr, ACC: tl.constexpr, IEEE: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """What ``rkv``'s key needs over every live slot before any slot can be ranked: the folded
    scores' sum, the sum of the unit keys, and the softmax's max and denominator of the
    similarities. Three passes over the keys; the folded scores are recomputed, not stored here,
    so the rank pass reads no value this one wrote (another thread's store may not be visible)."""
    total_lanes = tl.zeros([BLOCK_N], tl.float32)
    together = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, cap, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = _live_block(VALID, row, n, cap, slot, GENERAL)
        sc = _folded_scores(q, k_base, s_kn, SCORE, row, n, key_ok, g_ok, od, d_ok, slot, k_new, lse, cap, scaling,
                            decay, ACC, IEEE)
        total_lanes += tl.where(key_ok, sc, 0.0)
        k, norm, inverse = _live_keys(k_base, s_kn, n, key_ok, od, d_ok, slot, k_new)
        together += tl.sum(inverse[:, None] * k, 0)
    # torch.finfo(float32).tiny (2**-126), as eager's clamp. Written exactly: Triton types a float
    # literal below 2**-126 as float64, and the rank loop then failed to compile on a GPU
    total = tl.maximum(tl.sum(total_lanes, 0), 1.1754943508222875e-38)
    others = tl.maximum(n_live - 1, 1).to(tl.float32)
    max_lanes = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for start in range(0, cap, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = _live_block(VALID, row, n, cap, slot, GENERAL)
        max_lanes = tl.maximum(max_lanes, _rkv_similarity(k_base, s_kn, n, key_ok, od, d_ok, slot, k_new, together, others))
    r_max = tl.max(max_lanes, 0)
    sum_lanes = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, cap, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = _live_block(VALID, row, n, cap, slot, GENERAL)
        r = _rkv_similarity(k_base, s_kn, n, key_ok, od, d_ok, slot, k_new, together, others)
        sum_lanes += tl.where(key_ok, tl.exp(r - r_max), 0.0)
    return total, together, r_max, tl.sum(sum_lanes, 0), others


@triton.jit
def decode_step_kernel(
    Q, K_NEW, V_NEW, KEYS, VALUES, SCORE, ORDINAL, VALID, SLOT, VICTIM, N_REAL, RECENT_START, SINKS, HEAVY, RECENT,
    OUT,
    s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_sb, s_sh,
    hkv, g, cap, d, dv, scaling, decay, weight,
    GENERAL: tl.constexpr, ACC: tl.constexpr, KEY: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The decode step of ``core/step.py`` for one (sequence, KV head): write the new key, value
    and ordinal into a free slot, attend (the output), fold the group's mass into the score (ACC:
    0 none, 1 add, 2 replace, 3 fade by ``decay`` first), rank the candidates (KEY: 0 the score, 1
    the score per query that saw the key, 2 the ordinal, 3 ``rkv``'s key from the live keys; the
    row's recent window and sinks shielded) and evict the lowest.

    Dense (``GENERAL`` False): every slot is live but ``SLOT``, the one free slot; the victim goes
    to ``VICTIM``, the next step's slot, and the window is ``RECENT_START`` + 1. General: the
    first free slot (``VALID``) takes the token, free slots are neither attended nor ranked, and
    a victim goes only when the row's live slots then exceed ``HEAVY + RECENT`` (still filling up:
    none). ``n_real`` and the dense window advance outside (once per sequence, not per head)."""
    bh = tl.program_id(0)
    b, h = bh // hkv, bh % hkv
    gi, od, odv = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    g_ok, d_ok, dv_ok = gi < g, od < d, odv < dv
    row = b * s_sb + h * s_sh
    if GENERAL:
        # the first free slot (eager's argmin over valid) and the live slots before the write
        first = tl.full([BLOCK_N], cap, tl.int32)
        live = tl.zeros([BLOCK_N], tl.int32)
        for start in range(0, cap, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            alive = tl.load(VALID + row + n, mask=n < cap, other=1) != 0
            first = tl.minimum(first, tl.where(alive, cap, n))
            live += (alive & (n < cap)).to(tl.int32)
        slot = tl.min(first, 0)
        n_live = tl.sum(live, 0) + 1
    else:
        slot = tl.load(SLOT + bh)
        n_live = cap  # every slot is live once the free one takes the token
    q = tl.load(Q + (bh * g + gi)[:, None] * d + od[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_new = tl.load(K_NEW + bh * d + od, mask=d_ok, other=0.0)
    v_new = tl.load(V_NEW + bh * dv + odv, mask=dv_ok, other=0.0)
    n_old = tl.load(N_REAL + b)
    k_base, v_base = KEYS + b * s_kb + h * s_kh, VALUES + b * s_vb + h * s_vh
    tl.store(k_base + slot * s_kn + od, k_new, mask=d_ok)
    tl.store(v_base + slot * s_vn + odv, v_new, mask=dv_ok)
    tl.store(ORDINAL + row + slot, n_old)
    if ACC == 0:  # otherwise the mass pass below writes the slot's score
        tl.store(SCORE + row + slot, 0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for start in range(0, cap, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = _live_block(VALID, row, n, cap, slot, GENERAL)
        s = _group_logits(q, k_base, s_kn, n, key_ok, od, d_ok, slot, k_new, scaling, IEEE)
        s = tl.where(key_ok[None, :] & g_ok[:, None], s, float("-inf"))
        v = tl.load(v_base + n[:, None] * s_vn + odv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        v = tl.where((n == slot)[:, None], v_new[None, :], v)
        m_i, l_i, acc = _online_step(s, v, m_i, l_i, acc, IEEE)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(OUT + (bh * g + gi)[:, None] * dv + odv[None, :], (acc / l_safe[:, None]).to(OUT.dtype.element_ty),
             mask=g_ok[:, None] & dv_ok[None, :])
    lse = m_i + tl.log(l_safe)
    n_new = n_old + 1
    if GENERAL:
        window = n_new - tl.load(RECENT + b)
    else:
        window = tl.load(RECENT_START + b) + 1
    if KEY == 3:
        total, together, r_max, r_sum, others = _rkv_sums(
            q, k_base, s_kn, SCORE, VALID, row, slot, k_new, lse, n_live, cap, scaling, decay,
            od, d_ok, g_ok, GENERAL, ACC, IEEE, BLOCK_N, BLOCK_D)
    # per lane, the lowest rank so far and its first slot (lane j sees slots j, j + BLOCK_N, ...)
    best = tl.full([BLOCK_N], float("inf"), tl.float32)
    best_at = tl.zeros([BLOCK_N], tl.int32)
    for start in range(0, cap, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        key_ok = _live_block(VALID, row, n, cap, slot, GENERAL)
        o = tl.load(ORDINAL + row + n, mask=n < cap, other=0)
        o = tl.where(n == slot, n_old, o)
        sc = _folded_scores(q, k_base, s_kn, SCORE, row, n, key_ok, g_ok, od, d_ok, slot, k_new, lse, cap, scaling,
                            decay, ACC, IEEE)
        if ACC != 0:
            tl.store(SCORE + row + n, sc, mask=n < cap)
        if KEY == 0:
            rank = sc
        elif KEY == 1:
            rank = sc / tl.maximum(n_new - o, 1).to(tl.float32)
        elif KEY == 2:
            rank = o.to(tl.float32)
        else:
            r = _rkv_similarity(k_base, s_kn, n, key_ok, od, d_ok, slot, k_new, together, others)
            redundancy = tl.exp(r - r_max) / r_sum
            rank = weight * (sc / total) - (1.0 - weight) * redundancy
        shielded = (o >= window) | (n >= cap)
        if GENERAL:
            shielded = shielded | ~key_ok
        if HAS_SINKS:
            shielded = shielded | (o < tl.load(SINKS + b))
        rank = tl.where(shielded, float("inf"), rank)
        better = rank < best  # strictly lower: a lane keeps its first slot of a tie
        best_at = tl.where(better, n, best_at)
        best = tl.where(better, rank, best)
    # the first slot holding the lowest rank, as torch.argmin picks (slot 0 when none is a candidate)
    low = tl.min(best, 0)
    best_i = tl.min(tl.where(best == low, best_at, cap), 0)
    if GENERAL:
        # eager's ``evict``: only a row over its budget loses a slot, and only a candidate
        evicts = (n_live > tl.load(HEAVY + b) + tl.load(RECENT + b)) & (low < float("inf"))
        tl.store(VALID + row + slot, 1, mask=~(evicts & (best_i == slot)))
        tl.store(VALID + row + best_i, 0, mask=evicts)
    else:
        tl.store(VALID + row + slot, 1, mask=best_i != slot)
        tl.store(VALID + row + best_i, 0)
        tl.store(VICTIM + bh, best_i)
