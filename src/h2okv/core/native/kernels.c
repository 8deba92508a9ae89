/* h2okv's CPU kernels: the loops that cost one dispatched tensor op per line in eager PyTorch.
 *
 * Built at first use by h2okv/core/native/build.py with the system C compiler (no Python headers,
 * no torch headers: a plain shared library called through ctypes). Float32 only.
 *
 * scan_block: the per-token recurrence of core/scan.py (per-token eviction over a whole call)
 * for a block of queries. decode_dense: the at-budget decode step of core/step.py for a dense
 * buffer (budget + 1 slots, no free slot once the new token is written), or for heads of uneven
 * budgets whose live slots are packed at the front of their buffer (core/storage.py: SlotStorage.pack_live):
 * each (sequence, KV head) then uses its first budget + 1 slots only, from its own offset of
 * flat buffers when the layer holds only those (core/storage.py: RaggedSlots).
 *
 * The rule is the one of core/step.py: candidates are keys that are not blocked (free, evicted,
 * sinks) and not in the recent window (ordinal >= window start); the lowest rank goes, the first
 * index on ties (torch.argmin's rule). Rank and accumulation are coded by the caller
 * (core/native/rules.py maps the policy's hooks onto them).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { ACC_NONE = 0, ACC_ADD = 1, ACC_REPLACE = 2, ACC_DECAY = 3 };
enum { KEY_SCORE = 0, KEY_MEAN = 1, KEY_ORDINAL = 2, KEY_RKV = 3 };

/* e^x for x <= 0 (a softmax after its max is subtracted), eight lanes at a time with GCC/Clang
 * vector extensions (plain loops around expf or floorf do not vectorise): range reduction to
 * [-ln2/2, ln2/2], a degree-6 polynomial (Cephes' expf coefficients), the exponent set through
 * the bits. Below -87 (and for -inf: masked keys) the result is exactly 0. */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

static inline vf8 exp_nonpos8(vf8 x) {
    vi8 low = x < -87.0f; /* all ones where x < -87 (or -inf) */
    vf8 xc = (vf8)(((vi8)x & ~low) | ((vi8)((vf8){0} - 87.0f) & low));
    /* for x <= 0, truncating x/ln2 - 0.5 rounds to nearest */
    vi8 ni = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, vi8);
    vf8 n = __builtin_convertvector(ni, vf8);
    vf8 r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    vf8 p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
             + 1.6666665459e-1f) * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    vf8 e = p * (vf8)((ni + 127) << 23);
    return (vf8)((vi8)e & ~low);
}

/* row[k] = e^(row[k] - m) for k < n; returns their sum (lanes summed in a fixed order) */
static float exp_shifted(float *row, float m, int64_t n) {
    vf8 acc = {0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        vf8 x;
        memcpy(&x, row + k, sizeof x);
        x = exp_nonpos8(x - m);
        memcpy(row + k, &x, sizeof x);
        acc += x;
    }
    if (k < n) { /* the tail through the same lanes, padded with -inf (e = 0) */
        vf8 x;
        for (int j = 0; j < 8; j++) x[j] = k + j < n ? row[k + j] - m : -INFINITY;
        x = exp_nonpos8(x);
        for (int j = 0; j < 8 && k + j < n; j++) row[k + j] = x[j];
        acc += x;
    }
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}

/* softmax of row[k] + bias[k] (bias NULL: none) in place; adds the probabilities into mass (NULL: not) */
static void softmax_row(float *restrict row, const float *restrict bias, float *restrict mass, int64_t n) {
    float m = -INFINITY;
    if (bias) {
        #pragma omp simd
        for (int64_t k = 0; k < n; k++) row[k] += bias[k];
    }
    #pragma omp simd reduction(max : m)
    for (int64_t k = 0; k < n; k++) m = row[k] > m ? row[k] : m;
    float inv = 1.0f / exp_shifted(row, m, n);
    if (mass) {
        #pragma omp simd
        for (int64_t k = 0; k < n; k++) {
            row[k] *= inv;
            mass[k] += row[k];
        }
    } else {
        #pragma omp simd
        for (int64_t k = 0; k < n; k++) row[k] *= inv;
    }
}

static void accumulate(float *restrict score, const float *restrict mass, int64_t n, int mode) {
    if (mode == ACC_ADD) {
        #pragma omp simd
        for (int64_t k = 0; k < n; k++) score[k] += mass[k];
    } else if (mode == ACC_REPLACE) {
        memcpy(score, mass, (size_t)n * sizeof(float));
    }
}

/* the victim among n keys: lowest rank outside the shield, first index on ties; 0 when every key
 * is shielded (torch.argmin over all +inf) */
/* a key's rank, +inf where it is shielded (blocked, in the recent window, a sink) */
static inline float rank_of(const float *score, const int64_t *ordinal, const uint8_t *blocked, int64_t k,
                            int64_t window_start, int64_t sinks, int64_t n_real, int key) {
    int64_t o = ordinal[k];
    int shielded = (blocked ? blocked[k] : 0) | (o >= window_start) | (o < sinks);
    float rank = key == KEY_SCORE ? score[k]
               : key == KEY_MEAN ? score[k] / (float)(n_real - o < 1 ? 1 : n_real - o)
               : (float)o;
    return shielded ? INFINITY : rank;
}

static int64_t victim(const float *score, const int64_t *ordinal, const uint8_t *blocked, int64_t n,
                      int64_t window_start, int64_t sinks, int64_t n_real, int key) {
    /* two passes: the lowest rank (a vectorised min), then the first key holding it */
    float best = INFINITY;
    #pragma omp simd reduction(min : best)
    for (int64_t k = 0; k < n; k++) {
        float r = rank_of(score, ordinal, blocked, k, window_start, sinks, n_real, key);
        best = r < best ? r : best;
    }
    for (int64_t k = 0; k < n; k++)
        if (rank_of(score, ordinal, blocked, k, window_start, sinks, n_real, key) == best) return k;
    return 0;
}

/* Tokens start .. start + blk - 1 of a per-token scan. logits [rows, g, blk, width] (contiguous)
 * hold the scaled logits on entry and the probabilities on return; bias (0 live, -inf not),
 * blocked, score, ordinal are [rows, stride] with the first width keys in use. mass: scratch of
 * width floats. */
void scan_block(float *logits, float *bias, uint8_t *blocked, float *score, const int64_t *ordinal,
                int64_t rows, int64_t g, int64_t blk, int64_t width, int64_t stride,
                int64_t first_new, int64_t n0, int64_t recent, int64_t evict_from, int64_t start,
                int acc, int key, int evicts, float *mass) {
    for (int64_t r = 0; r < rows; r++) {
        float *b = bias + r * stride, *sc = score + r * stride;
        uint8_t *bl = blocked + r * stride;
        const int64_t *od = ordinal + r * stride;
        for (int64_t t = 0; t < blk; t++) {
            int64_t i = start + t;
            b[first_new + i] = 0.0f; /* write token i */
            if (acc != ACC_NONE) memset(mass, 0, (size_t)width * sizeof(float));
            for (int64_t h = 0; h < g; h++) {
                float *row = logits + ((r * g + h) * blk + t) * width;
                softmax_row(row, b, acc != ACC_NONE ? mass : NULL, width);
            }
            accumulate(sc, mass, width, acc);
            if (evicts && i >= evict_from) {
                int64_t v = victim(sc, od, bl, width, n0 + i + 1 - recent, INT64_MIN, n0 + i + 1, key);
                b[v] = -INFINITY;
                bl[v] = 1;
            }
        }
    }
}

/* q . k over d floats: eight lanes at a time (no horizontal sum per step), then the lanes */
static inline float dot(const float *q, const float *k, int64_t d) {
    vf8 acc = {0};
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) {
        vf8 a, b;
        memcpy(&a, q + j, sizeof a);
        memcpy(&b, k + j, sizeof b);
        acc += a * b;
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; j < d; j++) s += q[j] * k[j];
    return s;
}

/* One KV head's g query heads over cap slots: p [g, cap] gets the probabilities, out [g, dv] the
 * output. Slot-major, so each key and value row is read once for the whole group. */
static void attend_group(const float *q, const float *keys, const float *values, float *p, float *out,
                         int64_t g, int64_t cap, int64_t d, int64_t dv, float scaling) {
    for (int64_t c = 0; c < cap; c++) {
        const float *kc = keys + c * d;
        for (int64_t h = 0; h < g; h++) p[h * cap + c] = dot(q + h * d, kc, d) * scaling;
    }
    for (int64_t h = 0; h < g; h++) softmax_row(p + h * cap, NULL, NULL, cap);
    memset(out, 0, (size_t)(g * dv) * sizeof(float));
    for (int64_t c = 0; c < cap; c++) {
        const float *vc = values + c * dv;
        for (int64_t h = 0; h < g; h++) {
            float w = p[h * cap + c], *o = out + h * dv;
            #pragma omp simd
            for (int64_t j = 0; j < dv; j++) o[j] += w * vc[j];
        }
    }
}

/* rkv's key (policies/rkv.py) of n live slots (keys [n, d]) into work[2n .. 3n): weight * I -
 * (1 - weight) * R, with I each slot's share of the summed score and R the softmax of each key's
 * mean cosine similarity to the other n - 1 keys, computed as u_i . sum_j u_j - u_i . u_i (u the
 * unit keys): two passes over the keys. work: 3n + d floats (norms, inverse norms, ranks, the
 * sum of unit keys), in the order of the tensor ops so the ranks agree with them. */
static const float *rkv_ranks(const float *sc, const float *keys, int64_t n, int64_t d, float weight, float *work) {
    float *norm = work, *inverse = work + n, *rank = work + 2 * n, *together = work + 3 * n;
    float total = 0.0f;
    for (int64_t c = 0; c < n; c++) total += sc[c];
    total = total > 1.17549435e-38f ? total : 1.17549435e-38f; /* torch.finfo(float32).tiny */
    memset(together, 0, (size_t)d * sizeof(float));
    for (int64_t c = 0; c < n; c++) {
        const float *kc = keys + c * d;
        norm[c] = sqrtf(dot(kc, kc, d));
        inverse[c] = 1.0f / (norm[c] > 1e-12f ? norm[c] : 1e-12f);
        #pragma omp simd
        for (int64_t j = 0; j < d; j++) together[j] += inverse[c] * kc[j];
    }
    float others = (float)(n - 1 < 1 ? 1 : n - 1), m = -INFINITY;
    for (int64_t c = 0; c < n; c++) {
        float self = norm[c] * inverse[c];
        rank[c] = (dot(keys + c * d, together, d) * inverse[c] - self * self) / others;
        m = rank[c] > m ? rank[c] : m;
    }
    float inv = 1.0f / exp_shifted(rank, m, n);
    for (int64_t c = 0; c < n; c++) rank[c] = weight * (sc[c] / total) - (1.0f - weight) * (rank[c] * inv);
    return rank;
}

/* The dense at-budget decode step for rows = B * Hkv (sequence, KV head) pairs with g query
 * heads each. Per pair: write the new key/value/ordinal/score into `slot` (the only free slot),
 * attend over its n slots (n = width[pair], or cap when width is NULL; the slots past n are free
 * and never read; the pair's slots start at slot base[pair], or pair * cap when base is NULL)
 * (q [rows, g, d]; out [rows, g, dv]), fold the mass into the score,
 * advance the row's window (recent_start) and n_real by one, evict one, and store the victim
 * as the next step's slot. Per-sequence values (n_real, recent_start, sinks) are indexed by
 * pair / heads. p: scratch of g * cap floats; work: rkv's scratch (3 * cap + d floats), else NULL.
 * decay and weight are the policy's numbers for ACC_DECAY and KEY_RKV (unused otherwise). */
void decode_dense(const float *q, const float *k_new, const float *v_new,
                  float *keys, float *values, float *score, int64_t *ordinal, uint8_t *valid,
                  int64_t *slot, int64_t *n_real, int64_t *recent_start, const int64_t *sinks,
                  const int64_t *width, const int64_t *base, float *out, int64_t rows, int64_t heads, int64_t g, int64_t cap,
                  int64_t d, int64_t dv, float scaling, int acc, int key, float decay, float weight, float *p,
                  float *work) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t seq = r / heads, s = slot[r], n = width ? width[r] : cap, off = base ? base[r] : r * cap;
        float *kr = keys + off * d, *vr = values + off * dv, *sc = score + off;
        int64_t *od = ordinal + off;
        memcpy(kr + s * d, k_new + r * d, (size_t)d * sizeof(float));
        memcpy(vr + s * dv, v_new + r * dv, (size_t)dv * sizeof(float));
        od[s] = n_real[seq];
        sc[s] = 0.0f;
        valid[off + s] = 1;
        attend_group(q + r * g * d, kr, vr, p, out + r * g * dv, g, n, d, dv, scaling);
        if (acc != ACC_NONE) {
            /* the group's mass first, then folded in: the order of eager's sum and add */
            for (int64_t c = 0; c < n; c++) {
                float m = 0.0f;
                for (int64_t h = 0; h < g; h++) m += p[h * n + c];
                /* decay: older mass fades first (mul, then add: two roundings, as eager's mul_ and add_) */
                float kept = acc == ACC_DECAY ? sc[c] * decay : sc[c];
                sc[c] = acc == ACC_REPLACE ? m : kept + m;
            }
        }
        /* n_real and the window advance once per sequence: after its last KV head */
        int64_t nr = n_real[seq] + 1, ws = recent_start[seq] + 1;
        /* rkv ranks by a key computed from the keys, then as a score */
        const float *ranked = key == KEY_RKV ? rkv_ranks(sc, kr, n, d, weight, work) : sc;
        int64_t v = victim(ranked, od, NULL, n, ws, sinks ? sinks[seq] : INT64_MIN, nr, key == KEY_RKV ? KEY_SCORE : key);
        valid[off + v] = 0;
        slot[r] = v;
        if (r % heads == heads - 1) {
            n_real[seq] = nr;
            recent_start[seq] = ws;
        }
    }
}
