/* Shared helpers and cross-file entry points of Spindle's CPU kernels (AVX-512).
 *
 * native.py compiles every .c file of this directory into one library (cc -O3 -march=native -fopenmp) and
 * calls it through ctypes. Every buffer is contiguous; the Python side checks shapes, dtypes and strides.
 * All arithmetic is fp32: bfloat16 and GGUF-quantized operands are widened in registers.
 */
#ifndef SPINDLE_KERNELS_H
#define SPINDLE_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

/* Packed weight formats (gemm.c). Every format keeps 64 output columns per tile, so one GEMM loop serves all. */
enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_Q4_1 = 2, FMT_Q8_0 = 3 };

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept */
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = {(uint32_t)b << 16};
    return v.f;
}

static inline __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* e^x for x <= 0 (scores minus their running max): 2^n * e^(f ln 2), |f| <= 1/2, degree-7 Taylor polynomial
 * (relative error < 1e-7); below -100 the result flushes to 0 as expf's would underflow. */
static inline __m512 exp512_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* y[b, :] = x[b, :] / sqrt(mean(x[b, :]^2) + eps) * w, for B rows of H floats (y may be x). */
static inline void rms_norm(const float* x, const float* w, float* y, int64_t B, int64_t H, float eps) {
    for (int64_t b = 0; b < B; b++) {
        const float* xr = x + b * H;
        float* yr = y + b * H;
        __m512 s = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= H; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(xr + i), _mm512_loadu_ps(xr + i), s);
        float ss = _mm512_reduce_add_ps(s);
        for (; i < H; i++) ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; i++) yr[i] = xr[i] * r * w[i];
    }
}

/* act[b, f] = silu(gu[b, f]) * gu[b, F + f]; silu(g) = g * sigmoid(g), sigmoid from e^-|g| (no overflow). */
static inline void silu_mul(const float* gu, float* act, int64_t B, int64_t F) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t b = 0; b < B; b++) {
        const float* g = gu + b * 2 * F;
        const float* u = g + F;
        float* o = act + b * F;
        int64_t f = 0;
        for (; f + 16 <= F; f += 16) {
            const __m512 gv = _mm512_loadu_ps(g + f);
            const __m512 e = exp512_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
            const __mmask16 pos = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
            const __m512 num = _mm512_mask_blend_ps(pos, e, one); /* sigmoid = 1/(1+e) or e/(1+e) */
            const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + f, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + f)));
        }
        for (; f < F; f++) o[f] = g[f] / (1.0f + expf(-g[f])) * u[f];
    }
}

/* gemm.c: y[M,N] = x[M,K] @ w[N,K]^T over a packed weight p of format fmt; y fp32 or bf16 (y_bf16). */
void spindle_gemm_packed(const float* x, const void* p, void* y, int64_t M, int64_t N, int64_t K, int fmt, int y_bf16,
                         int nthreads);

/* decode.c: paged decode attention with q rows `q_stride` floats apart (q [B, Hq, D] when q_stride = Hq * D). */
int spindle_paged_decode_strided(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                                 const int64_t* block_table, const int64_t* seq_lens, float* out, float* lse,
                                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W, int64_t nblocks,
                                 float scale, int es, int64_t splits, int nthreads);

#endif
