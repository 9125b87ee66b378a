/* Rotary position embedding of a step's query and key heads, and the keys and values written to
   the paged 16-bit pool, in one call a layer (speculative/fast.py calls it; torch took about a
   dozen small ops for the same: slices, a concatenation, negation, products, a sum, a stack, a
   transpose, a cast and an indexed write).

   The arithmetic is torch's, operation for operation, so the results are bitwise the same:
     x'[i] = x[i] * cos[i] + rot[i] * sin[i],  rot[i] = -x[i + D/2] (i < D/2), x[i - D/2] (else)
   each product rounded to float, then the sum (built with -ffp-contract=off: no fused
   multiply-adds); the 16-bit values are rounded to nearest, ties to even, as torch's casts round.

   heads: R rows, row_stride floats apart; a row holds Hq query heads, then Hkv key heads, then
          Hkv value heads, D floats each. The query and key heads are rotated in place.
   cos, sin: [R, D] float32
   pool:  this layer's [2, Hkv, S, D] in float16 (bf16 = 0) or bfloat16 (bf16 = 1): row r's key
          and value heads go to slot slots[r]
   D is even. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN, as torch writes it */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline void store16(const float *src, uint16_t *dst, int64_t n, int bf16) {
    int64_t i = 0;
    if (!bf16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        for (; i < n; i++) dst[i] = to_bf16(src[i]);
    }
}

static inline void rotate(float *x, const float *c, const float *s, int D) {
    const int half = D / 2;
    float out[512];
    for (int i = 0; i < half; i++) out[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int i = half; i < D; i++) out[i] = x[i] * c[i] + x[i - half] * s[i];
    memcpy(x, out, (size_t)D * sizeof(float));
}

int osd_rope_kv(float *heads, int64_t row_stride, int64_t R, int Hq, int Hkv, int D, const float *cos,
                const float *sin, uint16_t *pool, int bf16, int64_t S, const int64_t *slots) {
    if (D % 2 || D > 512) return 1;
    for (int64_t r = 0; r < R; r++) {
        float *row = heads + r * row_stride;
        const float *c = cos + r * D, *s = sin + r * D;
        for (int h = 0; h < Hq + Hkv; h++) rotate(row + (int64_t)h * D, c, s, D);
        const int64_t slot = slots[r];
        for (int h = 0; h < Hkv; h++) {
            store16(row + (int64_t)(Hq + h) * D, pool + ((int64_t)h * S + slot) * D, D, bf16);  /* key */
            store16(row + (int64_t)(Hq + Hkv + h) * D, pool + ((int64_t)(Hkv + h) * S + slot) * D, D, bf16);  /* value */
        }
    }
    return 0;
}
