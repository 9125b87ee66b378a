/* Causal attention of query rows over keys and values read in place from a paged 16-bit pool
   (speculative/attend.py builds and calls it).

   Each (query row, head) is computed by the same code in the same order, whatever else shares
   the call: scores, softmax and the weighted sum in double precision, rounded to float once at
   the end. A row's output therefore does not depend on how rows are batched, chunked or padded
   (there is no padding: each row reads exactly its own L = pos + 1 keys), nor on the threads
   (a row is never split between them).

   Work is shared, not arithmetic: consecutive rows of one sequence (a verify step's k + 1 rows, a
   prompt chunk's) are taken up to SUB at a time, and each key and value is widened once for all of
   them and all the heads of its group; each row still does its own operations in its own order.

   pool:  [2, Hkv, S, D] float16 (bf16 = 0) or bfloat16 (bf16 = 1): this layer's keys, then values
   q:     R rows; row r's head h at q + r * q_stride + h * D (float32)
   out:   [R, Hq * D] float32
   slots: row r's key positions 0..pos[r] are pool slots slots[off[r]], ..., slots[off[r] + pos[r]]
   work:  scratch of at least SUB * (Hq / Hkv) * (max pos + 1 + 2 D) doubles for each of
   ``threads`` OpenMP threads, work_stride apart (row groups and key-value heads are shared
   between them: torch's own threads, when this library is loaded into a process that has loaded
   torch's libgomp)
   D is a multiple of 8, at most 256. Needs AVX2 and F16C (x86-64 of the last ten years). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define MAXD 256
#define MAXG 16
#define SUB 8  /* rows of one sequence taken together */

/* 8 16-bit values -> 8 doubles */
static inline void widen8(const uint16_t *src, double *dst, int bf16) {
    __m128i h = _mm_loadu_si128((const __m128i *)src);
    __m256 f = bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
    _mm256_storeu_pd(dst, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    _mm256_storeu_pd(dst + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
}

/* glibc's vector exp (libmvec, 4 doubles; accurate to a few ulp): the softmax's exp was most of
   the kernel's time with the scalar one */
extern __m256d _ZGVdN4v_exp(__m256d x);

/* w[l] = exp(w[l] - mx) for l < L, four at a time from l = 0 (the tail padded), so each score
   goes through the same function whatever L is */
static inline void exp_shifted(double *w, int64_t L, double mx) {
    const __m256d m = _mm256_set1_pd(mx);
    int64_t l = 0;
    for (; l + 4 <= L; l += 4) _mm256_storeu_pd(w + l, _ZGVdN4v_exp(_mm256_sub_pd(_mm256_loadu_pd(w + l), m)));
    if (l < L) {
        double t[4] = {mx, mx, mx, mx};
        for (int64_t i = l; i < L; i++) t[i - l] = w[i];
        _mm256_storeu_pd(t, _ZGVdN4v_exp(_mm256_sub_pd(_mm256_loadu_pd(t), m)));
        for (int64_t i = l; i < L; i++) w[i] = t[i - l];
    }
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
    /* row groups: consecutive rows of one sequence at consecutive positions, at most SUB */
    int64_t *first = (int64_t *)malloc((size_t)(R + 1) * sizeof(int64_t));
    if (first == NULL) return -2;
    int64_t n = 0;
    for (int64_t r = 0; r < R; r++)
        if (r == 0 || off[r] != off[r - 1] || pos[r] != pos[r - 1] + 1 || r - first[n - 1] >= SUB) first[n++] = r;
    first[n] = R;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < n * Hkv; task++) {
        const int64_t r0 = first[task / Hkv];
        const int nr = (int)(first[task / Hkv + 1] - r0), kh = (int)(task % Hkv);
        const int64_t Lmax = pos[r0 + nr - 1] + 1;  /* the last row reads the most keys */
        const int64_t *sl = slots + off[r0];
        const int m = nr * g;  /* (row, head) pairs: pair i = row i / g, head i % g */
        double *work = work_all + omp_get_thread_num() * work_stride;
        double *qd = work + (int64_t)m * Lmax, *acc = qd + (int64_t)m * D;
        double row[MAXD], sum[SUB * MAXG];
        const uint16_t *K = pool + (int64_t)kh * S * D;
        const uint16_t *V = pool + (int64_t)(Hkv + kh) * S * D;
        for (int i = 0; i < m; i++) {
            const float *qr = q + (r0 + i / g) * q_stride + (int64_t)(kh * g + i % g) * D;
            for (int d = 0; d < D; d++) qd[i * D + d] = (double)qr[d];
        }
        for (int64_t l = 0; l < Lmax; l++) {  /* scores: each key widened once for the group */
            const uint16_t *k = K + sl[l] * D;
            for (int d = 0; d < D; d += 8) widen8(k + d, row + d, bf16);
            for (int i = 0; i < m; i++)
                if (l <= pos[r0 + i / g]) work[i * Lmax + l] = dot(qd + i * D, row, D) * scale;
        }
        for (int i = 0; i < m; i++) {  /* softmax, unnormalised, over the row's own keys */
            const int64_t L = pos[r0 + i / g] + 1;
            double *w = work + i * Lmax, mx = -INFINITY, s = 0.0;
            for (int64_t l = 0; l < L; l++) mx = w[l] > mx ? w[l] : mx;
            exp_shifted(w, L, mx);
            for (int64_t l = 0; l < L; l++) s += w[l];
            sum[i] = s;
            for (int d = 0; d < D; d++) acc[i * D + d] = 0.0;
        }
        for (int64_t l = 0; l < Lmax; l++) {  /* weighted values: each value widened once */
            const uint16_t *v = V + sl[l] * D;
            for (int d = 0; d < D; d += 8) widen8(v + d, row + d, bf16);
            for (int i = 0; i < m; i++) {
                if (l > pos[r0 + i / g]) continue;
                const double p = work[i * Lmax + l];
                double *a = acc + i * D;
                for (int d = 0; d < D; d++) a[d] += p * row[d];
            }
        }
        for (int i = 0; i < m; i++) {
            float *o = out + (r0 + i / g) * (int64_t)Hq * D + (int64_t)(kh * g + i % g) * D;
            for (int d = 0; d < D; d++) o[d] = (float)(acc[i * D + d] / sum[i]);
        }
    }
    free(first);
    return 0;
}
