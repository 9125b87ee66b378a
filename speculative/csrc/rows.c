/* What the engine keeps of a verification's logits, one pass over each row instead of torch's
   softmax, top-k and argmax (three passes and three calls a sequence; speculative/sampling.py
   calls it, `target_summary`):
     argmax[r]: the index of the row's largest value, the first one where several are equal
               (torch.argmax's rule);
     ids[r][0..K-1], probs[r][...]: the K largest values, largest first (equal values: smaller
               index first), and softmax(row) at them;
     tail[r]:  1 - the sum of those K probabilities, at least 0.
   softmax(row)_i = exp(x_i - max) / Z with Z = sum_j exp(x_j - max): exp by a polynomial (Cephes'
   expf: |relative error| < 2e-7 on the range used), Z summed over 16 lanes in a fixed order. So
   a row's results depend on that row alone, never on the rows beside it or the threads.
   x: [R][V] float32 rows `stride` apart; 1 <= K <= min(V, 64). Returns 0, or -2 where a row holds a
   NaN or fewer than K values above -inf: the caller then takes torch's ops. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_K 64

/* exp(x) for x <= 0 (x - max): Cephes' expf reduction and polynomial; below -87 it is 0. The
   scalar and the vector forms do the same operations. */
#define EXP_LO -87.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define P0 1.9875691500e-4f
#define P1 1.3981999507e-3f
#define P2 8.3334519073e-3f
#define P3 4.1665795894e-2f
#define P4 1.6666665459e-1f
#define P5 5.0000001201e-1f

static inline float exp_neg(float x) {
    const float xc = x < EXP_LO ? EXP_LO : x;
    const float n = nearbyintf(xc * LOG2E);
    float r = xc - n * LN2_HI;
    r = r - n * LN2_LO;
    float p = P0;
    p = p * r + P1;
    p = p * r + P2;
    p = p * r + P3;
    p = p * r + P4;
    p = p * r + P5;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } s;
    s.i = ((int32_t)n + 127) << 23;
    const float e = p * s.f;
    return x < EXP_LO ? 0.0f : e;
}

#define VEXP(PS, SI, set1, max, mul, sub, add, round, cvt, slli, addi, set1i, cast, cmp_keep)            \
    {                                                                                                \
        const PS xc = max(v, set1(EXP_LO));                                                          \
        const PS n = round(mul(xc, set1(LOG2E)));                                                    \
        PS r = sub(xc, mul(n, set1(LN2_HI)));                                                        \
        r = sub(r, mul(n, set1(LN2_LO)));                                                            \
        PS p = set1(P0);                                                                             \
        p = add(mul(p, r), set1(P1));                                                                \
        p = add(mul(p, r), set1(P2));                                                                \
        p = add(mul(p, r), set1(P3));                                                                \
        p = add(mul(p, r), set1(P4));                                                                \
        p = add(mul(p, r), set1(P5));                                                                \
        p = add(add(mul(mul(p, r), r), r), set1(1.0f));                                              \
        const SI s = slli(addi(cvt(n), set1i(127)), 23);                                             \
        e = cmp_keep(mul(p, cast(s)), v);                                                            \
    }

/* sum_i exp(x_i - mx) over 16 lanes (lane j takes i = j mod 16), then the lanes in order */
#if defined(__AVX512F__)
static inline __m512 keep512(__m512 e, __m512 v) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_set1_ps(EXP_LO), _CMP_GE_OQ), e);
}
#define ROUND512(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static double sum_exp(const float *x, int64_t V, float mx) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(mx);
    for (int64_t c = 0; c < V; c += 16) {
        const __mmask16 in = V - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (V - c)) - 1u);
        const __m512 v = _mm512_sub_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in, x + c), m);
        __m512 e;
        VEXP(__m512, __m512i, _mm512_set1_ps, _mm512_max_ps, _mm512_mul_ps, _mm512_sub_ps, _mm512_add_ps, ROUND512,
             _mm512_cvtps_epi32, _mm512_slli_epi32, _mm512_add_epi32, _mm512_set1_epi32, _mm512_castsi512_ps, keep512)
        acc = _mm512_add_ps(acc, e);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    double z = 0.0;
    for (int j = 0; j < 16; j++) z += (double)lanes[j];
    return z;
}
#else
static inline __m256 keep256(__m256 e, __m256 v) {
    return _mm256_and_ps(_mm256_cmp_ps(v, _mm256_set1_ps(EXP_LO), _CMP_GE_OQ), e);
}
#define ROUND256(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
static double sum_exp(const float *x, int64_t V, float mx) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 m = _mm256_set1_ps(mx);
    float part[16];
    for (int64_t c = 0; c < V; c += 16) {
        const float *src = x + c;
        if (V - c < 16) {  /* the last lanes: past the row they count exp(-inf) = 0 */
            for (int j = 0; j < 16; j++) part[j] = c + j < V ? x[c + j] : -INFINITY;
            src = part;
        }
        for (int h = 0; h < 2; h++) {
            const __m256 v = _mm256_sub_ps(_mm256_loadu_ps(src + 8 * h), m);
            __m256 e;
            VEXP(__m256, __m256i, _mm256_set1_ps, _mm256_max_ps, _mm256_mul_ps, _mm256_sub_ps, _mm256_add_ps, ROUND256,
                 _mm256_cvtps_epi32, _mm256_slli_epi32, _mm256_add_epi32, _mm256_set1_epi32, _mm256_castsi256_ps, keep256)
            acc[h] = _mm256_add_ps(acc[h], e);
        }
    }
    float lanes[16];
    _mm256_storeu_ps(lanes, acc[0]);
    _mm256_storeu_ps(lanes + 8, acc[1]);
    double z = 0.0;
    for (int j = 0; j < 16; j++) z += (double)lanes[j];
    return z;
}
#endif

static int one_row(const float *x, int64_t V, int K, int64_t *argmax, int64_t *ids, float *probs, float *tail) {
    float top[MAX_K] = {0};
    int64_t at[MAX_K] = {0};
    int n = 0;
    /* the K largest, kept sorted: a value enters only above the K-th (equal ones keep the earlier index) */
    for (int64_t c = 0; c < V; c += LANES) {
        const int64_t m = V - c < LANES ? V - c : LANES;
        const float bar = n < K ? -INFINITY : top[K - 1];
        int any = 0;
        for (int64_t j = 0; j < m; j++) any |= (x[c + j] > bar) | (x[c + j] != x[c + j]);
        if (!any) continue;
        for (int64_t j = 0; j < m; j++) {
            const float v = x[c + j];
            if (v != v) return -1; /* NaN: torch's rules for it */
            if (!(v > (n < K ? -INFINITY : top[K - 1]))) continue; /* -inf never enters */
            int i = n < K ? n++ : K - 1;
            while (i > 0 && top[i - 1] < v) {
                top[i] = top[i - 1];
                at[i] = at[i - 1];
                i--;
            }
            top[i] = v;
            at[i] = c + j;
        }
    }
    if (n < K) return -1; /* fewer than K values above -inf (NaN or -inf in the row): not summarised */
    const float mx = top[0];
    *argmax = at[0];
    const double z = sum_exp(x, V, mx);
    double kept = 0.0;
    for (int i = 0; i < K; i++) {
        ids[i] = at[i];
        probs[i] = (float)((double)exp_neg(top[i] - mx) / z);
        kept += (double)probs[i];
    }
    *tail = kept < 1.0 ? (float)(1.0 - kept) : 0.0f;
    return 0;
}

int osd_row_summary(const float *x, int64_t stride, int64_t R, int64_t V, int64_t K, int64_t *argmax, int64_t *ids,
                    float *probs, float *tail, int threads) {
    if (K < 1 || K > MAX_K || K > V || R < 0) return -1;
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (R > 4) reduction(| : bad)
    for (int64_t r = 0; r < R; r++)
        bad |= one_row(x + r * stride, V, (int)K, argmax + r, ids + r * K, probs + r * K, tail + r) != 0;
    return bad ? -2 : 0;
}
