/* Causal attention of query rows over keys and values read in place from a paged 16-bit pool
   (speculative/attend.py builds and calls it).

   Each (query row, head) is computed by the same code in the same order, whatever else shares
   the call: scores, softmax and the weighted sum in double precision, rounded to float once at
   the end. A row's output therefore does not depend on how rows are batched, chunked or padded
   (there is no padding: each row reads exactly its own L = pos + 1 keys), nor on the threads
   (a row is never split between them).

   pool:  [2, Hkv, S, D] float16 (bf16 = 0) or bfloat16 (bf16 = 1): this layer's keys, then values
   q:     R rows; row r's head h at q + r * q_stride + h * D (float32)
   out:   [R, Hq * D] float32
   slots: row r's key positions 0..pos[r] are pool slots slots[off[r]], ..., slots[off[r] + pos[r]]
   work:  scratch of at least (Hq / Hkv) * (max pos + 1) doubles for each of ``threads`` OpenMP
   threads, work_stride apart (rows and key-value heads are shared between them: torch's own
   threads, when this library is loaded into a process that has loaded torch's libgomp)
   D is a multiple of 8, at most 256. Needs AVX2 and F16C (x86-64 of the last ten years). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define MAXD 256
#define MAXG 16

/* 8 16-bit values -> 8 doubles */
static inline void widen8(const uint16_t *src, double *dst, int bf16) {
    __m128i h = _mm_loadu_si128((const __m128i *)src);
    __m256 f = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
    _mm256_storeu_pd(dst, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    _mm256_storeu_pd(dst + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
}

static inline double dot(const double *a, const double *b, int D) {
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    for (int d = 0; d < D; d += 8) {
        s0 = _mm256_add_pd(s0, _mm256_mul_pd(_mm256_loadu_pd(a + d), _mm256_loadu_pd(b + d)));
        s1 = _mm256_add_pd(s1, _mm256_mul_pd(_mm256_loadu_pd(a + d + 4), _mm256_loadu_pd(b + d + 4)));
    }
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(s0, s1));
    return (t[0] + t[1]) + (t[2] + t[3]);
}

int osd_attend(const uint16_t *pool, int bf16, int64_t S, int Hkv, int D,
               const float *q, int64_t q_stride, int Hq, float *out,
               const int64_t *slots, const int64_t *off, const int64_t *pos,
               int64_t R, double scale, double *work_all, int64_t work_stride, int threads) {
    const int g = Hq / Hkv;
    if (D % 8 || D > MAXD || g > MAXG || g * Hkv != Hq) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < R * Hkv; task++) {
        const int64_t r = task / Hkv;
        const int kh = (int)(task % Hkv);
        double qd[MAXG][MAXD], acc[MAXG][MAXD], row[MAXD], sum[MAXG];
        double *work = work_all + omp_get_thread_num() * work_stride;
        const int64_t L = pos[r] + 1;
        const int64_t *sl = slots + off[r];
        {
            const uint16_t *K = pool + (int64_t)kh * S * D;
            const uint16_t *V = pool + (int64_t)(Hkv + kh) * S * D;
            for (int j = 0; j < g; j++) {
                const float *qr = q + r * q_stride + (int64_t)(kh * g + j) * D;
                for (int d = 0; d < D; d++) qd[j][d] = (double)qr[d];
            }
            for (int64_t l = 0; l < L; l++) {  /* scores: each key widened once for the group's heads */
                const uint16_t *k = K + sl[l] * D;
                for (int d = 0; d < D; d += 8) widen8(k + d, row + d, bf16);
                for (int j = 0; j < g; j++) work[j * L + l] = dot(qd[j], row, D) * scale;
            }
            for (int j = 0; j < g; j++) {  /* softmax, unnormalised */
                double *w = work + j * L, mx = -INFINITY, s = 0.0;
                for (int64_t l = 0; l < L; l++) mx = w[l] > mx ? w[l] : mx;
                for (int64_t l = 0; l < L; l++) {
                    w[l] = exp(w[l] - mx);
                    s += w[l];
                }
                sum[j] = s;
                for (int d = 0; d < D; d++) acc[j][d] = 0.0;
            }
            for (int64_t l = 0; l < L; l++) {  /* weighted values: each value widened once */
                const uint16_t *v = V + sl[l] * D;
                for (int d = 0; d < D; d += 8) widen8(v + d, row + d, bf16);
                for (int j = 0; j < g; j++) {
                    const double p = work[j * L + l];
                    for (int d = 0; d < D; d++) acc[j][d] += p * row[d];
                }
            }
            for (int j = 0; j < g; j++) {
                float *o = out + r * (int64_t)Hq * D + (int64_t)(kh * g + j) * D;
                for (int d = 0; d < D; d++) o[d] = (float)(acc[j][d] / sum[j]);
            }
        }
    }
    return 0;
}
