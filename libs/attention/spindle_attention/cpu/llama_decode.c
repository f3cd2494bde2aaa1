/* One decode step through a stack of Llama decoder layers in a single call (B new tokens, one per sequence).
 *
 * The torch path runs ~25 small operators per layer; at decode batch sizes their dispatch costs more than the
 * arithmetic. This runs the same layer: RMSNorm -> fused QKV -> interleaved-pair RoPE on q and k -> K/V into the
 * paged cache at `slots` -> paged decode attention -> o_proj + residual -> RMSNorm -> fused gate/up -> SiLU(gate)
 * * up -> down + residual, with the GEMMs of gemm.c (the same kernel, so the same numbers, as the small-batch
 * Linear path) and the attention of decode.c. Everything is fp32; the cache may be fp32 or bf16.
 *
 * layers [L][12] int64: addresses and formats per layer, in the order of the LAYER_* enum below.
 * x [B,H] fp32 is the residual stream, updated in place; rope [B, D/2, 2] holds (cos, sin) per rotary pair.
 * phase_s (may be NULL) accumulates seconds per PHASE_* for profiling.
 */
#include <time.h>

#include "kernels.h"

enum { PHASE_GEMM, PHASE_ATTENTION, PHASE_OTHER, PHASES };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

enum {
    LAYER_IN_NORM, LAYER_POST_NORM, LAYER_K_CACHE, LAYER_V_CACHE,
    LAYER_QKV, LAYER_QKV_FMT, LAYER_O, LAYER_O_FMT, LAYER_GATE_UP, LAYER_GATE_UP_FMT, LAYER_DOWN, LAYER_DOWN_FMT,
    LAYER_FIELDS
};

/* (a + ib)(cos + i sin) on each interleaved pair of `heads` heads of one row. */
static void rope_row(float* x, const float* cs, int64_t heads, int64_t D) {
    for (int64_t h = 0; h < heads; h++) {
        float* p = x + h * D;
        for (int64_t i = 0; i < D / 2; i++) {
            const float a = p[2 * i], b = p[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
            p[2 * i] = a * c - b * s;
            p[2 * i + 1] = a * s + b * c;
        }
    }
}

static void store_row(void* cache, int64_t slot, int64_t n, const float* src, int es) {
    if (es == 2) {
        uint16_t* dst = (uint16_t*)cache + slot * n;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float*)cache + slot * n, src, (size_t)n * sizeof(float));
    }
}

static void add_into(float* x, const float* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_add_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) x[i] += y[i];
}

int spindle_llama_decode(float* x, int64_t B, int64_t L, const int64_t* layers, const float* rope,
                         const int64_t* slots, const int64_t* table, int64_t W, const int64_t* lens, int64_t H,
                         int64_t Hq, int64_t Hkv, int64_t D, int64_t F, int64_t bs, int64_t nblocks, int cache_es,
                         float eps, float scale, int64_t splits, int nthreads, double* phase_s) {
    const int64_t qkv_n = (Hq + 2 * Hkv) * D, kv_n = Hkv * D;
    for (int64_t b = 0; b < B; b++)
        if (slots[b] < 0 || slots[b] >= nblocks * bs) return -3;
    float* buf = (float*)malloc((size_t)(B * (H + qkv_n + Hq * D + 2 * F + F + H) + Hq * B) * sizeof(float));
    if (!buf) return -2;
    float* h = buf;                  /* [B,H] normalised input */
    float* qkv = h + B * H;          /* [B,qkv_n] */
    float* attn = qkv + B * qkv_n;   /* [B,Hq*D] */
    float* gu = attn + B * Hq * D;   /* [B,2F] */
    float* act = gu + B * 2 * F;     /* [B,F] */
    float* proj = act + B * F;       /* [B,H] */
    float* lse = proj + B * H;       /* [Hq,B] (unused) */
    double spent[PHASES] = {0.0, 0.0, 0.0}, t = now_s(), t1;
#define PHASE(p) (t1 = now_s(), spent[p] += t1 - t, t = t1)
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const int64_t* w = layers + l * LAYER_FIELDS;
        void* k_cache = (void*)w[LAYER_K_CACHE];
        void* v_cache = (void*)w[LAYER_V_CACHE];
        rms_norm(x, (const float*)w[LAYER_IN_NORM], h, B, H, eps);
        PHASE(PHASE_OTHER);
        spindle_gemm_packed(h, (const void*)w[LAYER_QKV], qkv, B, qkv_n, H, (int)w[LAYER_QKV_FMT], 0, nthreads);
        PHASE(PHASE_GEMM);
        for (int64_t b = 0; b < B; b++) {
            float* row = qkv + b * qkv_n;
            rope_row(row, rope + b * D, Hq + Hkv, D); /* q heads, then k heads: contiguous */
            store_row(k_cache, slots[b], kv_n, row + Hq * D, cache_es);
            store_row(v_cache, slots[b], kv_n, row + (Hq + Hkv) * D, cache_es);
        }
        PHASE(PHASE_OTHER);
        rc = spindle_paged_decode_strided(qkv, qkv_n, k_cache, v_cache, table, lens, attn, lse, B, Hq, Hkv, D, bs, W,
                                          nblocks, scale, cache_es, splits, nthreads);
        PHASE(PHASE_ATTENTION);
        spindle_gemm_packed(attn, (const void*)w[LAYER_O], proj, B, H, Hq * D, (int)w[LAYER_O_FMT], 0, nthreads);
        PHASE(PHASE_GEMM);
        add_into(x, proj, B * H);
        rms_norm(x, (const float*)w[LAYER_POST_NORM], h, B, H, eps);
        PHASE(PHASE_OTHER);
        spindle_gemm_packed(h, (const void*)w[LAYER_GATE_UP], gu, B, 2 * F, H, (int)w[LAYER_GATE_UP_FMT], 0, nthreads);
        PHASE(PHASE_GEMM);
        silu_mul(gu, act, B, F);
        PHASE(PHASE_OTHER);
        spindle_gemm_packed(act, (const void*)w[LAYER_DOWN], proj, B, H, F, (int)w[LAYER_DOWN_FMT], 0, nthreads);
        PHASE(PHASE_GEMM);
        add_into(x, proj, B * H);
        PHASE(PHASE_OTHER);
    }
#undef PHASE
    if (phase_s)
        for (int p = 0; p < PHASES; p++) phase_s[p] += spent[p];
    free(buf);
    return rc;
}
