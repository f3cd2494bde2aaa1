/* Small-batch GEMM over packed weights: y[M,N] = x[M,K] @ w[N,K]^T, the decode batch's matmuls.
 *
 * A packed weight is a sequence of tiles of NT = 64 output columns, each one sequential stream over K, so a
 * pass over a tile reads it once for MB rows of x and keeps 4 x 16-lane fp32 accumulators per row.
 *   FMT_F32 / FMT_BF16: [N/64][K][64] elements (bf16 widened in registers: this CPU family's bf16 dot
 *     instructions run at half the fp32 FMA rate).
 *   FMT_Q4_1 / FMT_Q8_0: GGUF blocks of 32 along K, kept quantized. Per (tile, block): 64 fp16 scales d (and for
 *     Q4_1 64 fp16 mins m), then the 32 x 64 quants (Q4_1: one byte per column holds k and k+1 as its low and high
 *     nibble). A weight is rebuilt as fma(d, q, m) (Q4_1) or d * q (Q8_0) in fp32: exactly the value GGUF's
 *     dequantization gives (d * q is exact in fp32, then one rounding), so the product equals the fp32 GEMM over
 *     the dequantized weight, in the same order of accumulation, bit for bit.
 * Every output row is computed the same way whatever M is, so a request's decode does not depend on its batch.
 */
#include "kernels.h"

#define NT 64 /* output columns per tile: four 16-lane fp32 accumulators */
#define MB 6  /* rows of x per pass over a tile */
#define QK 32 /* GGUF block length along K */
#define Q4_TILE (NT * 2 * 2 + QK * NT / 2) /* 1280 bytes: d, m, nibble pairs */
#define Q8_TILE (NT * 2 + QK * NT)         /* 2176 bytes: d, int8 quants */

/* w [N,K] (es bytes per element) -> p [ceil(N/64)][K][64]. */
void spindle_pack_weight(const void* w, void* p, int64_t N, int64_t K, int es) {
    const int64_t tiles = (N + NT - 1) / NT;
    memset(p, 0, (size_t)(tiles * K * NT * es));
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / NT, c = n % NT;
        for (int64_t k = 0; k < K; k++)
            memcpy((char*)p + ((t * K + k) * NT + c) * es, (const char*)w + (n * K + k) * es, (size_t)es);
    }
}

/* GGUF rows raw [N][K/32][block bytes] -> tiles as described above; padding columns get d = m = q = 0. */
void spindle_pack_gguf(const uint8_t* raw, uint8_t* p, int64_t N, int64_t K, int fmt) {
    const int64_t tiles = (N + NT - 1) / NT, kbs = K / QK;
    const int64_t tile_bytes = fmt == FMT_Q4_1 ? Q4_TILE : Q8_TILE, block_bytes = fmt == FMT_Q4_1 ? 20 : 34;
    memset(p, 0, (size_t)(tiles * kbs * tile_bytes));
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / NT, c = n % NT;
        for (int64_t kb = 0; kb < kbs; kb++) {
            const uint8_t* b = raw + (n * kbs + kb) * block_bytes;
            uint8_t* dst = p + (t * kbs + kb) * tile_bytes;
            memcpy(dst + 2 * c, b, 2); /* d */
            if (fmt == FMT_Q4_1) {
                memcpy(dst + 2 * NT + 2 * c, b + 2, 2); /* m */
                const uint8_t* qs = b + 4;              /* weight j: qs[j] & 15, weight j + 16: qs[j] >> 4 */
                for (int kp = 0; kp < QK / 2; kp++) {
                    const int k0 = 2 * kp, k1 = 2 * kp + 1;
                    const uint8_t q0 = k0 < 16 ? qs[k0] & 15 : qs[k0 - 16] >> 4;
                    const uint8_t q1 = k1 < 16 ? qs[k1] & 15 : qs[k1 - 16] >> 4;
                    dst[4 * NT + kp * NT + c] = (uint8_t)(q0 | (q1 << 4));
                }
            } else {
                for (int k = 0; k < QK; k++) dst[2 * NT + k * NT + c] = b[2 + k];
            }
        }
    }
}

#define GEMM_TILE(R, WT, LOAD)                                                                         \
    static void tile_##WT##_##R(const float* x, int64_t K, const WT* pt, __m512* out) {                \
        __m512 a[R][4];                                                                                \
        for (int i = 0; i < R; i++)                                                                    \
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();                                 \
        for (int64_t k = 0; k < K; k++) {                                                              \
            const WT* wk = pt + k * NT;                                                                \
            __m512 w0 = LOAD(wk), w1 = LOAD(wk + 16), w2 = LOAD(wk + 32), w3 = LOAD(wk + 48);          \
            for (int i = 0; i < R; i++) {                                                              \
                __m512 xb = _mm512_set1_ps(x[i * K + k]);                                              \
                a[i][0] = _mm512_fmadd_ps(xb, w0, a[i][0]);                                            \
                a[i][1] = _mm512_fmadd_ps(xb, w1, a[i][1]);                                            \
                a[i][2] = _mm512_fmadd_ps(xb, w2, a[i][2]);                                            \
                a[i][3] = _mm512_fmadd_ps(xb, w3, a[i][3]);                                            \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < R; i++)                                                                    \
            for (int j = 0; j < 4; j++) out[i * 4 + j] = a[i][j];                                      \
    }

static inline __m512 load16_f16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

/* GGUF tiles: the four 16-column groups are unrolled by hand (independent accumulator chains, no spills), and
 * a pass takes at most MBQ rows so that 4 * MBQ accumulators, the 8 scale/min vectors and the rebuilt weights
 * fit the 32 vector registers. */
#define MBQ 4

/* acc{0..3}[i] += x(i) * w{0..3} for the R rows of a GGUF tile pass (XI: the row's x value, in terms of i). */
#define ROWS_FMA4(R, XI, W0, W1, W2, W3)                                                                       \
    for (int i = 0; i < R; i++) {                                                                              \
        const __m512 xb = _mm512_set1_ps(XI);                                                                  \
        a0[i] = _mm512_fmadd_ps(xb, W0, a0[i]);                                                                \
        a1[i] = _mm512_fmadd_ps(xb, W1, a1[i]);                                                                \
        a2[i] = _mm512_fmadd_ps(xb, W2, a2[i]);                                                                \
        a3[i] = _mm512_fmadd_ps(xb, W3, a3[i]);                                                                \
    }

/* Q4_1: per pair of k, 64 bytes give the 64 columns' nibbles for k (low) and k + 1 (high). */
#define GEMM_TILE_Q4(R)                                                                                        \
    static void tile_q4_##R(const float* x, int64_t K, const uint8_t* pt, __m512* out) {                       \
        __m512 a0[R], a1[R], a2[R], a3[R];                                                                     \
        for (int i = 0; i < R; i++) a0[i] = a1[i] = a2[i] = a3[i] = _mm512_setzero_ps();                       \
        const __m512i lo = _mm512_set1_epi32(15);                                                              \
        for (int64_t kb = 0; kb < K / QK; kb++) {                                                              \
            const uint8_t* blk = pt + kb * Q4_TILE;                                                            \
            const __m512 d0 = load16_f16(blk), d1 = load16_f16(blk + 32), d2 = load16_f16(blk + 64),           \
                         d3 = load16_f16(blk + 96);                                                            \
            const __m512 m0 = load16_f16(blk + 128), m1 = load16_f16(blk + 160), m2 = load16_f16(blk + 192),   \
                         m3 = load16_f16(blk + 224);                                                           \
            const uint8_t* qs = blk + 4 * NT;                                                                  \
            for (int kp = 0; kp < QK / 2; kp++) {                                                              \
                const uint8_t* q = qs + kp * NT;                                                               \
                const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));                  \
                const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)));            \
                const __m512i b2 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 32)));            \
                const __m512i b3 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 48)));            \
                const int64_t k = kb * QK + 2 * kp;                                                            \
                const __m512 w0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(b0, lo)), m0);       \
                const __m512 w1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_and_si512(b1, lo)), m1);       \
                const __m512 w2 = _mm512_fmadd_ps(d2, _mm512_cvtepi32_ps(_mm512_and_si512(b2, lo)), m2);       \
                const __m512 w3 = _mm512_fmadd_ps(d3, _mm512_cvtepi32_ps(_mm512_and_si512(b3, lo)), m3);       \
                ROWS_FMA4(R, x[i * K + k], w0, w1, w2, w3);                                                    \
                const __m512 v0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)), m0);       \
                const __m512 v1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)), m1);       \
                const __m512 v2 = _mm512_fmadd_ps(d2, _mm512_cvtepi32_ps(_mm512_srli_epi32(b2, 4)), m2);       \
                const __m512 v3 = _mm512_fmadd_ps(d3, _mm512_cvtepi32_ps(_mm512_srli_epi32(b3, 4)), m3);       \
                ROWS_FMA4(R, x[i * K + k + 1], v0, v1, v2, v3);                                                \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < R; i++) {                                                                          \
            out[i * 4] = a0[i], out[i * 4 + 1] = a1[i], out[i * 4 + 2] = a2[i], out[i * 4 + 3] = a3[i];        \
        }                                                                                                      \
    }

#define GEMM_TILE_Q8(R)                                                                                        \
    static void tile_q8_##R(const float* x, int64_t K, const uint8_t* pt, __m512* out) {                       \
        __m512 a0[R], a1[R], a2[R], a3[R];                                                                     \
        for (int i = 0; i < R; i++) a0[i] = a1[i] = a2[i] = a3[i] = _mm512_setzero_ps();                       \
        for (int64_t kb = 0; kb < K / QK; kb++) {                                                              \
            const uint8_t* blk = pt + kb * Q8_TILE;                                                            \
            const __m512 d0 = load16_f16(blk), d1 = load16_f16(blk + 32), d2 = load16_f16(blk + 64),           \
                         d3 = load16_f16(blk + 96);                                                            \
            const uint8_t* qs = blk + 2 * NT;                                                                  \
            for (int kk = 0; kk < QK; kk++) {                                                                  \
                const uint8_t* q = qs + kk * NT;                                                               \
                const __m512 w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(                                        \
                                                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)))); \
                const __m512 w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                    \
                                                        _mm_loadu_si128((const __m128i*)(q + 16)))));          \
                const __m512 w2 = _mm512_mul_ps(d2, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                    \
                                                        _mm_loadu_si128((const __m128i*)(q + 32)))));          \
                const __m512 w3 = _mm512_mul_ps(d3, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                    \
                                                        _mm_loadu_si128((const __m128i*)(q + 48)))));          \
                ROWS_FMA4(R, x[i * K + kb * QK + kk], w0, w1, w2, w3);                                         \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < R; i++) {                                                                          \
            out[i * 4] = a0[i], out[i * 4 + 1] = a1[i], out[i * 4 + 2] = a2[i], out[i * 4 + 3] = a3[i];        \
        }                                                                                                      \
    }

/* Half tiles for passes of 5 to MBH rows: two 16-column groups (half h of the tile) over the whole K, so 2 * MBH
 * accumulators plus the scales fit the registers and the rebuilt weights serve twice as many rows as a 4-row
 * pass (the rebuild, not the FMAs, dominates). Each column still accumulates over k in order: same bits. */
#define MBH 8

#define GEMM_HALF_Q4(R)                                                                                        \
    static void half_q4_##R(const float* x, int64_t K, const uint8_t* pt, int h, __m512* out) {                \
        __m512 a0[R], a1[R];                                                                                   \
        for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm512_setzero_ps();                                       \
        const __m512i lo = _mm512_set1_epi32(15);                                                              \
        for (int64_t kb = 0; kb < K / QK; kb++) {                                                              \
            const uint8_t* blk = pt + kb * Q4_TILE;                                                            \
            const __m512 d0 = load16_f16(blk + 64 * h), d1 = load16_f16(blk + 64 * h + 32);                    \
            const __m512 m0 = load16_f16(blk + 128 + 64 * h), m1 = load16_f16(blk + 128 + 64 * h + 32);        \
            const uint8_t* qs = blk + 4 * NT + 32 * h;                                                         \
            for (int kp = 0; kp < QK / 2; kp++) {                                                              \
                const uint8_t* q = qs + kp * NT;                                                               \
                const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));                  \
                const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)));            \
                const int64_t k = kb * QK + 2 * kp;                                                            \
                const __m512 w0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(b0, lo)), m0);       \
                const __m512 w1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_and_si512(b1, lo)), m1);       \
                const __m512 v0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_srli_epi32(b0, 4)), m0);       \
                const __m512 v1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(b1, 4)), m1);       \
                for (int i = 0; i < R; i++) {                                                                  \
                    const __m512 xa = _mm512_set1_ps(x[i * K + k]), xb = _mm512_set1_ps(x[i * K + k + 1]);     \
                    a0[i] = _mm512_fmadd_ps(xb, v0, _mm512_fmadd_ps(xa, w0, a0[i]));                           \
                    a1[i] = _mm512_fmadd_ps(xb, v1, _mm512_fmadd_ps(xa, w1, a1[i]));                           \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < R; i++) out[i * 4 + 2 * h] = a0[i], out[i * 4 + 2 * h + 1] = a1[i];                \
    }

#define GEMM_HALF_Q8(R)                                                                                        \
    static void half_q8_##R(const float* x, int64_t K, const uint8_t* pt, int h, __m512* out) {                \
        __m512 a0[R], a1[R];                                                                                   \
        for (int i = 0; i < R; i++) a0[i] = a1[i] = _mm512_setzero_ps();                                       \
        for (int64_t kb = 0; kb < K / QK; kb++) {                                                              \
            const uint8_t* blk = pt + kb * Q8_TILE;                                                            \
            const __m512 d0 = load16_f16(blk + 64 * h), d1 = load16_f16(blk + 64 * h + 32);                    \
            const uint8_t* qs = blk + 2 * NT + 32 * h;                                                         \
            for (int kk = 0; kk < QK; kk++) {                                                                  \
                const uint8_t* q = qs + kk * NT;                                                               \
                const __m512 w0 = _mm512_mul_ps(                                                               \
                    d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))));         \
                const __m512 w1 = _mm512_mul_ps(                                                               \
                    d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))))); \
                for (int i = 0; i < R; i++) {                                                                  \
                    const __m512 xb = _mm512_set1_ps(x[i * K + kb * QK + kk]);                                 \
                    a0[i] = _mm512_fmadd_ps(xb, w0, a0[i]);                                                    \
                    a1[i] = _mm512_fmadd_ps(xb, w1, a1[i]);                                                    \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
        for (int i = 0; i < R; i++) out[i * 4 + 2 * h] = a0[i], out[i * 4 + 2 * h + 1] = a1[i];                \
    }

GEMM_HALF_Q4(5) GEMM_HALF_Q4(6) GEMM_HALF_Q4(7) GEMM_HALF_Q4(8)
GEMM_HALF_Q8(5) GEMM_HALF_Q8(6) GEMM_HALF_Q8(7) GEMM_HALF_Q8(8)
typedef void (*half_q_fn)(const float*, int64_t, const uint8_t*, int, __m512*);
static const half_q_fn HALF_Q4[MBH + 1] = {0, 0, 0, 0, 0, half_q4_5, half_q4_6, half_q4_7, half_q4_8};
static const half_q_fn HALF_Q8[MBH + 1] = {0, 0, 0, 0, 0, half_q8_5, half_q8_6, half_q8_7, half_q8_8};

GEMM_TILE(1, float, load16_f32) GEMM_TILE(2, float, load16_f32) GEMM_TILE(3, float, load16_f32)
GEMM_TILE(4, float, load16_f32) GEMM_TILE(5, float, load16_f32) GEMM_TILE(6, float, load16_f32)
GEMM_TILE(1, bf16_t, load16_bf16) GEMM_TILE(2, bf16_t, load16_bf16) GEMM_TILE(3, bf16_t, load16_bf16)
GEMM_TILE(4, bf16_t, load16_bf16) GEMM_TILE(5, bf16_t, load16_bf16) GEMM_TILE(6, bf16_t, load16_bf16)
GEMM_TILE_Q4(1) GEMM_TILE_Q4(2) GEMM_TILE_Q4(3) GEMM_TILE_Q4(4)
GEMM_TILE_Q8(1) GEMM_TILE_Q8(2) GEMM_TILE_Q8(3) GEMM_TILE_Q8(4)

typedef void (*tile_f32_fn)(const float*, int64_t, const float*, __m512*);
typedef void (*tile_bf16_fn)(const float*, int64_t, const bf16_t*, __m512*);
typedef void (*tile_q_fn)(const float*, int64_t, const uint8_t*, __m512*);
static const tile_f32_fn TILE_F32[MB + 1] = {0, tile_float_1, tile_float_2, tile_float_3,
                                             tile_float_4, tile_float_5, tile_float_6};
static const tile_bf16_fn TILE_BF16[MB + 1] = {0, tile_bf16_t_1, tile_bf16_t_2, tile_bf16_t_3,
                                               tile_bf16_t_4, tile_bf16_t_5, tile_bf16_t_6};
static const tile_q_fn TILE_Q4[MBQ + 1] = {0, tile_q4_1, tile_q4_2, tile_q4_3, tile_q4_4};
static const tile_q_fn TILE_Q8[MBQ + 1] = {0, tile_q8_1, tile_q8_2, tile_q8_3, tile_q8_4};

void spindle_gemm_packed(const float* x, const void* p, void* y, int64_t M, int64_t N, int64_t K, int fmt, int y_bf16,
                         int nthreads) {
    const int64_t tiles = (N + NT - 1) / NT;
    const int quant = fmt == FMT_Q4_1 || fmt == FMT_Q8_0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NT;
        const int nn = (N - n0) < NT ? (int)(N - n0) : NT;
        for (int64_t m0 = 0; m0 < M;) {
            const int64_t left = M - m0;
            int mm;
            __m512 acc[MBH * 4];
            const float* xm = x + m0 * K;
            if (quant) {
                const uint8_t* pt = (const uint8_t*)p + t * (K / QK) * (fmt == FMT_Q4_1 ? Q4_TILE : Q8_TILE);
                if (left > MBQ) {
                    mm = left < MBH ? (int)left : MBH;
                    for (int h = 0; h < 2; h++) (fmt == FMT_Q4_1 ? HALF_Q4 : HALF_Q8)[mm](xm, K, pt, h, acc);
                } else {
                    mm = (int)left;
                    (fmt == FMT_Q4_1 ? TILE_Q4 : TILE_Q8)[mm](xm, K, pt, acc);
                }
            } else {
                mm = left < MB ? (int)left : MB;
                if (fmt == FMT_BF16)
                    TILE_BF16[mm](xm, K, (const bf16_t*)p + t * K * NT, acc);
                else
                    TILE_F32[mm](xm, K, (const float*)p + t * K * NT, acc);
            }
            for (int i = 0; i < mm; i++) {
                float row[NT];
                for (int j = 0; j < 4; j++) _mm512_storeu_ps(row + 16 * j, acc[i * 4 + j]);
                if (y_bf16) {
                    uint16_t* yr = (uint16_t*)y + (m0 + i) * N + n0;
                    for (int c = 0; c < nn; c++) yr[c] = f32_to_bf16(row[c]);
                } else {
                    memcpy((float*)y + (m0 + i) * N + n0, row, (size_t)nn * sizeof(float));
                }
            }
            m0 += mm;
        }
    }
}
