/* Paged decode attention over a block-paged K/V cache (flash-decoding split over the context).
 *
 * q [B,Hq,D] fp32; caches [blocks, bs, Hkv, D] (es = 4 fp32 or 2 bf16); block_table [B,W] int64; seq_lens [B]
 * int64. out [B,Hq,D] fp32, lse [Hq,B] fp32 (natural log; an empty sequence gives out 0, lse -inf).
 * Work items are (sequence, KV head, split of the context); each keeps an online-softmax state for the
 * G = Hq/Hkv query heads sharing that KV head, so every K/V row is read once per item. */
#include "kernels.h"

#define CHUNK 32 /* tokens whose scores are computed before one softmax update */
#define MAXG 16

static inline float dot_row(const float* q, const void* k, int64_t D, int es) {
    __m512 s = _mm512_setzero_ps();
    int64_t d = 0;
    if (es == 2) {
        const uint16_t* kb = (const uint16_t*)k;
        for (; d + 16 <= D; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_bf16(kb + d), s);
        float r = _mm512_reduce_add_ps(s);
        for (; d < D; d++) r += q[d] * bf16_to_f32(kb[d]);
        return r;
    }
    const float* kf = (const float*)k;
    for (; d + 16 <= D; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kf + d), s);
    float r = _mm512_reduce_add_ps(s);
    for (; d < D; d++) r += q[d] * kf[d];
    return r;
}

static inline void axpy_row(float* acc, float a, const void* v, int64_t D, int es) {
    int64_t d = 0;
    const __m512 av = _mm512_set1_ps(a);
    if (es == 2) {
        const uint16_t* vb = (const uint16_t*)v;
        for (; d + 16 <= D; d += 16)
            _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(av, load16_bf16(vb + d), _mm512_loadu_ps(acc + d)));
        for (; d < D; d++) acc[d] += a * bf16_to_f32(vb[d]);
        return;
    }
    const float* vf = (const float*)v;
    for (; d + 16 <= D; d += 16)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(av, _mm512_loadu_ps(vf + d), _mm512_loadu_ps(acc + d)));
    for (; d < D; d++) acc[d] += a * vf[d];
}

/* state per (item, g): [m, l, acc[D]] */
static int decode_item(const float* q, const char* kc, const char* vc, const int64_t* table, int64_t nblocks,
                       int64_t t0, int64_t t1, int64_t h, int64_t G, int64_t Hkv, int64_t D, int64_t bs, int es,
                       float scale, float* state) {
    const int64_t row = Hkv * D * es; /* bytes per token slot */
    float s[MAXG][CHUNK];
    for (int64_t g = 0; g < G; g++) {
        float* st = state + g * (D + 2);
        st[0] = -INFINITY;
        st[1] = 0.0f;
        memset(st + 2, 0, (size_t)D * sizeof(float));
    }
    for (int64_t c0 = t0; c0 < t1; c0 += CHUNK) {
        const int64_t n = (t1 - c0) < CHUNK ? (t1 - c0) : CHUNK;
        const char* kp[CHUNK];
        const char* vp[CHUNK];
        for (int64_t j = 0; j < n; j++) {
            const int64_t t = c0 + j, blk = table[t / bs];
            if (blk < 0 || blk >= nblocks) return -1;
            const int64_t off = (blk * bs + t % bs) * row + h * D * es;
            kp[j] = kc + off;
            vp[j] = vc + off;
        }
        for (int64_t j = 0; j < n; j++)
            for (int64_t g = 0; g < G; g++) s[g][j] = dot_row(q + g * D, kp[j], D, es) * scale;
        for (int64_t g = 0; g < G; g++) {
            float* st = state + g * (D + 2);
            float mx = st[0];
            for (int64_t j = 0; j < n; j++) mx = s[g][j] > mx ? s[g][j] : mx;
            const float corr = expf(st[0] - mx); /* st[0] = -inf on the first chunk: corr 0 */
            float sum = 0.0f;
            for (int64_t j0 = 0; j0 < n; j0 += 16) {
                const __mmask16 lanes = (n - j0) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j0)) - 1);
                const __m512 e = exp512_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s[g] + j0), _mm512_set1_ps(mx)));
                _mm512_mask_storeu_ps(s[g] + j0, lanes, e);
                sum += _mm512_mask_reduce_add_ps(lanes, e);
            }
            st[0] = mx;
            st[1] = st[1] * corr + sum;
            for (int64_t d = 0; d < D; d++) st[2 + d] *= corr;
        }
        for (int64_t j = 0; j < n; j++)
            for (int64_t g = 0; g < G; g++) axpy_row(state + g * (D + 2) + 2, s[g][j], vp[j], D, es);
    }
    return 0;
}

/* The same item with the head dim a compile-time multiple of 16 (64, 128): one query head at a time, its q and
 * output accumulator in registers, the chunk's K/V rows re-read from L1 for each of the G heads. */
#define DECODE_ITEM_FIXED(NAME, DV, ET, LOAD)                                                                      \
    static int NAME(const float* q, const char* kc, const char* vc, const int64_t* table, int64_t nblocks,          \
                    int64_t t0, int64_t t1, int64_t h, int64_t G, int64_t Hkv, int64_t bs, float scale,             \
                    float* state) {                                                                                \
        const int64_t D = 16 * DV, row = Hkv * D; /* elements per token slot */                                    \
        for (int64_t g = 0; g < G; g++) {                                                                          \
            float* st = state + g * (D + 2);                                                                       \
            st[0] = -INFINITY;                                                                                     \
            st[1] = 0.0f;                                                                                          \
            memset(st + 2, 0, (size_t)D * sizeof(float));                                                          \
        }                                                                                                          \
        for (int64_t c0 = t0; c0 < t1; c0 += CHUNK) {                                                              \
            const int64_t n = (t1 - c0) < CHUNK ? (t1 - c0) : CHUNK;                                               \
            const ET* kp[CHUNK];                                                                                   \
            const ET* vp[CHUNK];                                                                                   \
            for (int64_t j = 0; j < n; j++) {                                                                      \
                const int64_t t = c0 + j, blk = table[t / bs];                                                     \
                if (blk < 0 || blk >= nblocks) return -1;                                                          \
                const int64_t off = (blk * bs + t % bs) * row + h * D;                                             \
                kp[j] = (const ET*)kc + off;                                                                       \
                vp[j] = (const ET*)vc + off;                                                                       \
            }                                                                                                      \
            for (int64_t g = 0; g < G; g++) {                                                                      \
                float* st = state + g * (D + 2);                                                                   \
                __m512 qv[DV], av[DV];                                                                             \
                float s[CHUNK];                                                                                    \
                for (int v = 0; v < DV; v++) qv[v] = _mm512_loadu_ps(q + g * D + 16 * v);                          \
                for (int64_t j = 0; j < n; j++) {                                                                  \
                    __m512 a = _mm512_mul_ps(qv[0], LOAD(kp[j]));                                                  \
                    for (int v = 1; v < DV; v++) a = _mm512_fmadd_ps(qv[v], LOAD(kp[j] + 16 * v), a);              \
                    s[j] = _mm512_reduce_add_ps(a) * scale;                                                        \
                }                                                                                                  \
                float mx = st[0];                                                                                  \
                for (int64_t j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;                                        \
                const float corr = expf(st[0] - mx);                                                               \
                float sum = 0.0f;                                                                                  \
                for (int64_t j0 = 0; j0 < n; j0 += 16) {                                                           \
                    const __mmask16 lanes = (n - j0) >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j0)) - 1); \
                    const __m512 e = exp512_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j0), _mm512_set1_ps(mx))); \
                    _mm512_mask_storeu_ps(s + j0, lanes, e);                                                       \
                    sum += _mm512_mask_reduce_add_ps(lanes, e);                                                    \
                }                                                                                                  \
                st[0] = mx;                                                                                        \
                st[1] = st[1] * corr + sum;                                                                        \
                const __m512 cv = _mm512_set1_ps(corr);                                                            \
                for (int v = 0; v < DV; v++) av[v] = _mm512_mul_ps(_mm512_loadu_ps(st + 2 + 16 * v), cv);          \
                for (int64_t j = 0; j < n; j++) {                                                                  \
                    const __m512 pj = _mm512_set1_ps(s[j]);                                                        \
                    for (int v = 0; v < DV; v++) av[v] = _mm512_fmadd_ps(pj, LOAD(vp[j] + 16 * v), av[v]);         \
                }                                                                                                  \
                for (int v = 0; v < DV; v++) _mm512_storeu_ps(st + 2 + 16 * v, av[v]);                             \
            }                                                                                                      \
        }                                                                                                          \
        return 0;                                                                                                  \
    }

DECODE_ITEM_FIXED(decode_item_f32_64, 4, float, load16_f32)
DECODE_ITEM_FIXED(decode_item_f32_128, 8, float, load16_f32)
DECODE_ITEM_FIXED(decode_item_bf16_64, 4, bf16_t, load16_bf16)
DECODE_ITEM_FIXED(decode_item_bf16_128, 8, bf16_t, load16_bf16)

static int decode_any(const float* q, const char* kc, const char* vc, const int64_t* table, int64_t nblocks,
                      int64_t t0, int64_t t1, int64_t h, int64_t G, int64_t Hkv, int64_t D, int64_t bs, int es,
                      float scale, float* state) {
    if (D == 64)
        return es == 2 ? decode_item_bf16_64(q, kc, vc, table, nblocks, t0, t1, h, G, Hkv, bs, scale, state)
                       : decode_item_f32_64(q, kc, vc, table, nblocks, t0, t1, h, G, Hkv, bs, scale, state);
    if (D == 128)
        return es == 2 ? decode_item_bf16_128(q, kc, vc, table, nblocks, t0, t1, h, G, Hkv, bs, scale, state)
                       : decode_item_f32_128(q, kc, vc, table, nblocks, t0, t1, h, G, Hkv, bs, scale, state);
    return decode_item(q, kc, vc, table, nblocks, t0, t1, h, G, Hkv, D, bs, es, scale, state);
}

int spindle_paged_decode_strided(const float* q, int64_t q_stride, const void* k_cache, const void* v_cache,
                                 const int64_t* block_table, const int64_t* seq_lens, float* out, float* lse,
                                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, int64_t W, int64_t nblocks,
                                 float scale, int es, int64_t splits, int nthreads) {
    const int64_t G = Hq / Hkv;
    if (G > MAXG || splits < 1) return -1;
    const int64_t width = D + 2, items = B * Hkv * splits;
    float* states = (float*)malloc((size_t)(items * G * width) * sizeof(float));
    if (!states) return -2;
    int bad = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / (Hkv * splits), h = (it / splits) % Hkv, sp = it % splits;
        const int64_t len = seq_lens[b], per = (len + splits - 1) / splits;
        const int64_t t0 = sp * per < len ? sp * per : len, t1 = (sp + 1) * per < len ? (sp + 1) * per : len;
        if (decode_any(q + b * q_stride + h * G * D, (const char*)k_cache, (const char*)v_cache, block_table + b * W,
                       nblocks, t0, t1, h, G, Hkv, D, bs, es, scale, states + it * G * width))
            bad = 1;
    }
    if (bad) {
        free(states);
        return -3;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t hq = h * G + g;
                float mx = -INFINITY;
                for (int64_t sp = 0; sp < splits; sp++) {
                    const float* st = states + (((b * Hkv + h) * splits + sp) * G + g) * width;
                    if (st[1] > 0.0f && st[0] > mx) mx = st[0];
                }
                float* o = out + (b * Hq + hq) * D;
                memset(o, 0, (size_t)D * sizeof(float));
                if (mx == -INFINITY) {
                    lse[hq * B + b] = -INFINITY;
                    continue;
                }
                float l = 0.0f;
                for (int64_t sp = 0; sp < splits; sp++) {
                    const float* st = states + (((b * Hkv + h) * splits + sp) * G + g) * width;
                    if (st[1] <= 0.0f) continue;
                    const float w = expf(st[0] - mx);
                    l += st[1] * w;
                    for (int64_t d = 0; d < D; d++) o[d] += st[2 + d] * w;
                }
                for (int64_t d = 0; d < D; d++) o[d] /= l;
                lse[hq * B + b] = mx + logf(l);
            }
    free(states);
    return 0;
}

int spindle_paged_decode(const float* q, const void* k_cache, const void* v_cache, const int64_t* block_table,
                         const int64_t* seq_lens, float* out, float* lse, int64_t B, int64_t Hq, int64_t Hkv,
                         int64_t D, int64_t bs, int64_t W, int64_t nblocks, float scale, int es, int64_t splits,
                         int nthreads) {
    return spindle_paged_decode_strided(q, Hq * D, k_cache, v_cache, block_table, seq_lens, out, lse, B, Hq, Hkv, D,
                                        bs, W, nblocks, scale, es, splits, nthreads);
}
