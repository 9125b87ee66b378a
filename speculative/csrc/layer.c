/* The fast path's decoder layers in one call a step (speculative/fast.py builds the table and
   calls it): the same native kernels the layer-by-layer path calls from Python (RMSNorm, the 4-bit
   products, the rotary write, attention over the pool), in the same order on the same buffers, so
   the results are bitwise the same; only the ~20 Python and torch calls a layer around them go.

   osd_silu_mul is the gated activation both paths use (torch's silu is not reproducible here: its
   exp is a vector library's): act[r, i] = g / (1 + exp(-g)) * u with g = gu[r, i], u = gu[r, I + i],
   exp from glibc's vector library 8 floats at a time from i = 0 (the tail padded), so each element
   goes through the same function whatever the width.

   osd_layers: for each layer l, table[l * 11 ...] holds the addresses of
     0 the input norm's weight (float32 [H])      1, 2 q/k/v fused: packed weights, scales (N = (Hq + 2 Hkv) D)
     3, 4 output projection (N = H)               5 the post-attention norm's weight
     6, 7 gate/up fused (N = 2 I)                 8, 9 down projection (N = H)
     10 the layer's pool [2, Hkv, S, D] (16 bits)
   and h [R, H] float32 is updated in place:
     x = norm(h); qkv = x Wqkv; rotate q, k and write k, v to new_slots; a = attend(q);
     h = h + a Wo; x = norm(h); gu = x Wgu; h = h + silu_mul(gu) Wd.
   scratch: R * (H + N_qkv + Hq D + 2 H + 3 I) floats; qwork: the products' scratch for the widest
   input (R * K + 8 R K / 32 bytes); awork: attention's (speculative/attend.py). */
#include "qmm.c"
#include "attend.c"
#include "rope.c"

extern __m256 _ZGVdN8v_expf(__m256 x);

static inline __m256 silu8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(g, _mm256_add_ps(one, e));
}

int osd_silu_mul(const float *gu, int64_t gu_stride, int64_t R, int64_t I, float *act) {
    for (int64_t r = 0; r < R; r++) {
        const float *g = gu + r * gu_stride, *u = g + I;
        float *o = act + r * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        if (i < I) {
            float tg[8] = {0}, tu[8] = {0}, to[8];
            for (int64_t j = i; j < I; j++) tg[j - i] = g[j], tu[j - i] = u[j];
            _mm256_storeu_ps(to, _mm256_mul_ps(silu8(_mm256_loadu_ps(tg)), _mm256_loadu_ps(tu)));
            for (int64_t j = i; j < I; j++) o[j] = to[j - i];
        }
    }
    return 0;
}

static inline void add_rows(float *h, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] = h[i] + y[i];
}

int osd_layers(const int64_t *table, int n_layers, float *h, int64_t R, int64_t H, int Hq, int Hkv, int D, int64_t I,
               double eps, const float *cos, const float *sin, const int64_t *new_slots, int64_t S, int bf16,
               const int64_t *slots, const int64_t *off, const int64_t *pos, double scale, float *scratch,
               uint8_t *qwork, double *awork, int64_t awork_stride, int threads) {
    const int64_t Nqkv = (int64_t)(Hq + 2 * Hkv) * D, A = (int64_t)Hq * D;
    float *x = scratch, *qkv = x + R * H, *att = qkv + R * Nqkv, *o = att + R * A, *gu = o + R * H,
          *act = gu + R * 2 * I, *dn = act + R * I;
    for (int l = 0; l < n_layers; l++) {
        const int64_t *t = table + 11 * l;
        uint16_t *pool = (uint16_t *)t[10];
        int rc = 0;
        osd_rms_norm(h, H, (const float *)t[0], R, H, eps, x, threads);
        rc |= osd_q4_mm((const uint8_t *)t[1], (const uint16_t *)t[2], Nqkv, H, x, H, R, qkv, qwork, threads);
        rc |= osd_rope_kv(qkv, Nqkv, R, Hq, Hkv, D, cos, sin, pool, bf16, S, new_slots);
        rc |= osd_attend(pool, bf16, S, Hkv, D, qkv, Nqkv, Hq, att, slots, off, pos, R, scale, awork, awork_stride, threads);
        rc |= osd_q4_mm((const uint8_t *)t[3], (const uint16_t *)t[4], H, A, att, A, R, o, qwork, threads);
        add_rows(h, o, R * H);
        osd_rms_norm(h, H, (const float *)t[5], R, H, eps, x, threads);
        rc |= osd_q4_mm((const uint8_t *)t[6], (const uint16_t *)t[7], 2 * I, H, x, H, R, gu, qwork, threads);
        osd_silu_mul(gu, 2 * I, R, I, act);
        rc |= osd_q4_mm((const uint8_t *)t[8], (const uint16_t *)t[9], H, I, act, I, R, dn, qwork, threads);
        add_rows(h, dn, R * H);
        if (rc != 0) return 100 + l;
    }
    return 0;
}
