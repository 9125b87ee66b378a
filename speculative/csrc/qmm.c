/* Products of quantised weights with rows rounded to 8 bits, by integer dot products
   (speculative/qmatmul.py packs the weights and calls them), as llama.cpp computes them for the
   GGUF's own types:
     osd_q4_mm: W in 4-bit groups of 32 (a scale d and a minimum m per group: Q4_1)
     osd_q8_mm: W in 8-bit groups of 32 (a scale d per group: Q8_0, the embedded GGUF's embeddings,
                which the head shares)
   Each row of x is rounded to 8 bits per group of 32, like llama.cpp's Q8_1: one scale xs per
   group and xsum, the scale times the sum of the group's integers, both in float32 (llama.cpp
   keeps them in float16: doing so too brought the outputs no closer to its and cost agreement
   with the float model, docs/fast.md, "How close each runtime is").

   Each output y[r, n] is computed by the same code in the same order, whatever else shares the
   call: per group g an exact integer sum s_g = sum_i q[n, i] xq[r, i], then
       4 bits:  acc = fma((float)s_g, d[n, g] * xs[r, g], acc);  acc = fma(m[n, g], xsum[r, g], acc)
       8 bits:  acc = fma((float)s_g, d[n, g] * xs[r, g], acc)
   over g = 0, 1, ... in order. A row's
   result therefore does not depend on the rows beside it, on the threads (an output is never split
   between them) nor on the instruction set: the AVX-512 VNNI and AVX2 paths
   do the same float operations lane by lane on the same integers.

   4 bits, wq: [N/16][K/32][4][64] bytes: for 16 outputs (a tile) and a group, chunk c holds, at
        byte 4 * lane + b, q[n = 16 t + lane][k = 32 g + 4 c + b] in its low nibble and
        q[n][k = 32 g + 4 (c + 4) + b] in its high nibble (q in 0..15)
     dm: [N/16][K/32][2][16] float16: d of the tile's 16 outputs, then m
   8 bits, w8: [N/16][K/32][8][64] int8: chunk c holds w[16 t + lane][32 g + 4 c + b] at 4 lane + b
     wsum: [N/16][K/32][16] int32: each output's sum of the group's weights;
     d8: [N/16][K/32][16] float16: each output's scale of the group
   x:   [M, K] float32 rows x_stride apart;  y: [M, N] float32 (N a multiple of 16, K of 32)
   work: M * K bytes + 8 * M * K / 32 bytes of scratch (the rows in 8 bits, their scales and sums) */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

/* a row of x in 8 bits: xq[i] = round(x[i] * 127 / max |x|) over the group (ties to even), the
   group's scale xs_g = max |x| / 127, and xsum_g = xs_g * sum_i xq[i], the sum of the rounded row:
   the weights' minimum then multiplies the same rounded values as their steps do. Taking the exact
   sum instead would leave the steps' rounding error uncentred (q is 0..15), which measurably costs
   agreement with the float model (docs/fast.md, "The native matrix kernels"). */
static void quantise_row(const float *x, int64_t K, int8_t *xq, float *xs, float *xsum) {
    for (int64_t g = 0; g < K / 32; g++) {
        const float *v = x + 32 * g;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        const float s = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            xq[32 * g + i] = (int8_t)lrintf(v[i] * inv);
            sum += xq[32 * g + i];
        }
        xs[g] = s;
        xsum[g] = s * (float)sum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ROWS 4
/* rows r0 .. r0 + nr - 1 (nr <= ROWS) of one tile: the tile's weights are unpacked once a group
   and used for each row */
static inline void tile_rows(const uint8_t *wt, const uint16_t *dmt, int64_t G, const int8_t *xq, const float *xs,
                             const float *xsum, int64_t K, int64_t r0, int nr, float *y, int64_t N, int64_t n0) {
    __m512 acc[ROWS];
    for (int j = 0; j < ROWS; j++) acc[j] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; g++) {
        __m512i w[8];
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512((const void *)(wt + g * 256 + c * 64));
            w[c] = _mm512_and_si512(v, low);
            w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dmt + g * 32)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dmt + g * 32 + 16)));
        for (int j = 0; j < nr; j++) {
            const int64_t r = r0 + j;
            const int32_t *xr = (const int32_t *)(xq + r * K + 32 * g);
            __m512i s = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) s = _mm512_dpbusd_epi32(s, w[c], _mm512_set1_epi32(xr[c]));
            const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xs[r * G + g]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), ds, acc[j]);
            acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), acc[j]);
        }
    }
    for (int j = 0; j < nr; j++) _mm512_storeu_ps(y + (r0 + j) * N + n0, acc[j]);
}
/* 8 bits: VNNI multiplies unsigned by signed bytes, so the row goes in as xq + 128 (its bytes with
   the top bit flipped) and 128 * wsum comes off the integer sum */
static inline void tile_rows8(const int8_t *wt, const int32_t *wst, const uint16_t *dt, int64_t G, const int8_t *xq,
                              const float *xs, int64_t K, int64_t r0, int nr, float *y, int64_t N, int64_t n0) {
    __m512 acc[ROWS];
    for (int j = 0; j < ROWS; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i w[8];
        for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512((const void *)(wt + g * 512 + c * 64));
        const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512((const void *)(wst + g * 16)), 7);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dt + g * 16)));
        for (int j = 0; j < nr; j++) {
            const int64_t r = r0 + j;
            const int32_t *xr = (const int32_t *)(xq + r * K + 32 * g);
            __m512i s = _mm512_setzero_si512();
            for (int c = 0; c < 8; c++) s = _mm512_dpbusd_epi32(s, _mm512_set1_epi32(xr[c] ^ (int32_t)0x80808080), w[c]);
            const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xs[r * G + g]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s, off)), ds, acc[j]);
        }
    }
    for (int j = 0; j < nr; j++) _mm512_storeu_ps(y + (r0 + j) * N + n0, acc[j]);
}
#else
#define ROWS 4
/* AVX2: the tile as two halves of 8 outputs; the same float operations lane by lane */
static inline void tile_rows(const uint8_t *wt, const uint16_t *dmt, int64_t G, const int8_t *xq, const float *xs,
                             const float *xsum, int64_t K, int64_t r0, int nr, float *y, int64_t N, int64_t n0) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 acc[ROWS];
        for (int j = 0; j < ROWS; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            __m256i w[8];
            for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(wt + g * 256 + c * 64 + 32 * h));
                w[c] = _mm256_and_si256(v, low);
                w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dmt + g * 32 + 8 * h)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dmt + g * 32 + 16 + 8 * h)));
            for (int j = 0; j < nr; j++) {
                const int64_t r = r0 + j;
                const int32_t *xr = (const int32_t *)(xq + r * K + 32 * g);
                __m256i s = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++)  /* u8 x s8 pairs fit 16 bits: 2 * 15 * 128 < 32768 */
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w[c], _mm256_set1_epi32(xr[c])), ones));
                const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(xs[r * G + g]));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), ds, acc[j]);
                acc[j] = _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * G + g]), acc[j]);
            }
        }
        for (int j = 0; j < nr; j++) _mm256_storeu_ps(y + (r0 + j) * N + n0 + 8 * h, acc[j]);
    }
}
/* AVX2: |w| times x with w's sign (maddubs multiplies unsigned by signed bytes; pairs stay within
   16 bits since |x| <= 127) */
static inline void tile_rows8(const int8_t *wt, const int32_t *wst, const uint16_t *dt, int64_t G, const int8_t *xq,
                              const float *xs, int64_t K, int64_t r0, int nr, float *y, int64_t N, int64_t n0) {
    const __m256i ones = _mm256_set1_epi16(1);
    (void)wst;
    for (int h = 0; h < 2; h++) {
        __m256 acc[ROWS];
        for (int j = 0; j < ROWS; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t g = 0; g < G; g++) {
            __m256i w[8], u[8];
            for (int c = 0; c < 8; c++) {
                w[c] = _mm256_loadu_si256((const __m256i *)(wt + g * 512 + c * 64 + 32 * h));
                u[c] = _mm256_abs_epi8(w[c]);
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dt + g * 16 + 8 * h)));
            for (int j = 0; j < nr; j++) {
                const int64_t r = r0 + j;
                const int32_t *xr = (const int32_t *)(xq + r * K + 32 * g);
                __m256i s = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++)
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u[c], _mm256_sign_epi8(_mm256_set1_epi32(xr[c]), w[c])), ones));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(xs[r * G + g])), acc[j]);
            }
        }
        for (int j = 0; j < nr; j++) _mm256_storeu_ps(y + (r0 + j) * N + n0 + 8 * h, acc[j]);
    }
}
#endif

/* the rows in 8 bits (work: xq [M][K], then xs and xsum [M][K/32]) */
typedef struct { int8_t *xq; float *xs, *xsum; } Rows;

static Rows quantise_rows(const float *x, int64_t x_stride, int64_t M, int64_t K, uint8_t *work) {
    const int64_t G = K / 32;
    Rows q = {(int8_t *)work, (float *)(work + M * K), (float *)(work + M * K) + M * G};
    for (int64_t r = 0; r < M; r++) quantise_row(x + r * x_stride, K, q.xq + r * K, q.xs + r * G, q.xsum + r * G);
    return q;
}

int osd_q4_mm(const uint8_t *wq, const uint16_t *dm, int64_t N, int64_t K, const float *x, int64_t x_stride,
              int64_t M, float *y, uint8_t *work, int threads) {
    if (N % 16 || K % 32 || M < 0) return -1;
    const int64_t G = K / 32;
    const Rows q = quantise_rows(x, x_stride, M, K, work);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < N / 16; t++)
        for (int64_t r0 = 0; r0 < M; r0 += ROWS)
            tile_rows(wq + t * G * 256, dm + t * G * 32, G, q.xq, q.xs, q.xsum, K, r0, M - r0 < ROWS ? (int)(M - r0) : ROWS,
                      y, N, 16 * t);
    return 0;
}

int osd_q8_mm(const int8_t *w8, const int32_t *wsum, const uint16_t *d8, int64_t N, int64_t K, const float *x,
              int64_t x_stride, int64_t M, float *y, uint8_t *work, int threads) {
    if (N % 16 || K % 32 || M < 0) return -1;
    const int64_t G = K / 32;
    const Rows q = quantise_rows(x, x_stride, M, K, work);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < N / 16; t++)
        for (int64_t r0 = 0; r0 < M; r0 += ROWS)
            tile_rows8(w8 + t * G * 512, wsum + t * G * 16, d8 + t * G * 16, G, q.xq, q.xs, K, r0, M - r0 < ROWS ? (int)(M - r0) : ROWS,
                       y, N, 16 * t);
    return 0;
}

/* RMSNorm of R rows of K (x rows x_stride apart; y contiguous): y = x / sqrt(mean(x^2) + eps) * w,
   the mean of squares summed in double precision in order, each row alone. */
int osd_rms_norm(const float *x, int64_t x_stride, const float *w, int64_t R, int64_t K, double eps, float *y,
                 int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (R > 8)
    for (int64_t r = 0; r < R; r++) {
        const float *v = x + r * x_stride;
        double ss = 0.0;
        for (int64_t i = 0; i < K; i++) ss += (double)v[i] * (double)v[i];
        const float inv = (float)(1.0 / sqrt(ss / (double)K + eps));
        float *o = y + r * K;
        for (int64_t i = 0; i < K; i++) o[i] = (v[i] * inv) * w[i];
    }
    return 0;
}
