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

/* gemm.c: y[M,N] = x[M,K] @ w[N,K]^T over a packed weight p of format fmt; y fp32 or bf16 (y_bf16). */
void spindle_gemm_packed(const float* x, const void* p, void* y, int64_t M, int64_t N, int64_t K, int fmt, int y_bf16,
                         int nthreads);

/* decode.c: paged decode attention with q rows `q_stride` floats apart (q [B, Hq, D] when q_stride = Hq * D). */
int spindle_paged_decode_strided(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                                 const int64_t* block_table, const int64_t* seq_lens, float* out, float* lse,
                                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W, int64_t nblocks,
                                 float scale, int es, int64_t splits, int nthreads);

#endif
