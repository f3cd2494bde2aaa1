/* Causal attention of one prefill chunk over a paged K/V cache (flash attention, AVX-512, fp32).
 *
 * q [n, Hq, D] holds queries at positions p0 .. p0+n-1; keys 0 .. p0+n-1 are read from caches
 * [blocks, bs, Hkv, D] through `table` (a contiguous [tokens, Hkv, D] is one block with bs = tokens).
 * out [n, Hq, D], lse [Hq, n] (natural log). D must be a multiple of 64.
 *
 * GQA is folded: the G = Hq/Hkv query heads of one KV head are consecutive rows (row r is token r/G, head r%G),
 * so every K/V tile is loaded once for all of them. K is packed transposed in tiles of 64 keys and V row-major,
 * once per call. A work item is a group of panels (PR rows each) of one KV head; it walks the key tiles its rows
 * can see, each tile staying in L1 while every panel of the group uses it: scores of a panel and a tile live in
 * 24 registers, then an online-softmax update, then P.V into the panel's output accumulator. */
#include "kernels.h"

#define BK 64      /* keys per tile: 4 vectors */
#define PR 6       /* rows per panel: 6 x 4 score accumulators */
#define MAX_NP 32  /* panels per work item: more panels share each K/V tile while it is in L1 */
#define MAXD 256

typedef struct {
    float* q; /* [PR, D] scaled queries */
    float* o; /* [PR, D] unnormalised output */
    float m[PR], l[PR];
    int64_t limit[PR]; /* last visible key of each row */
    int64_t rows;      /* real rows (the rest repeat row 0 and are dropped) */
} Panel;

static void pack_kv(const float* kc, const float* vc, const int64_t* table, int64_t bs, int64_t total, int64_t h,
                    int64_t tile, int64_t Hkv, int64_t D, float* kt, float* vp) {
    /* kt [D][BK] of this tile (K transposed), vp [BK][D]; keys past `total` are zeros */
    for (int64_t j = 0; j < BK; j++) {
        const int64_t t = tile * BK + j;
        float* vrow = vp + j * D;
        if (t >= total) {
            memset(vrow, 0, (size_t)D * sizeof(float));
            for (int64_t d = 0; d < D; d++) kt[d * BK + j] = 0.0f;
            continue;
        }
        const int64_t off = ((table[t / bs] * bs + t % bs) * Hkv + h) * D;
        memcpy(vrow, vc + off, (size_t)D * sizeof(float));
        for (int64_t d = 0; d < D; d++) kt[d * BK + j] = kc[off + d];
    }
}

static void panel_tile(Panel* P, const float* kt, const float* vp, int64_t j0, int64_t D) {
    __m512 s[PR][4];
#pragma GCC unroll 6
    for (int r = 0; r < PR; r++)
        for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * BK), k1 = _mm512_loadu_ps(kt + d * BK + 16),
                     k2 = _mm512_loadu_ps(kt + d * BK + 32), k3 = _mm512_loadu_ps(kt + d * BK + 48);
#pragma GCC unroll 6
        for (int r = 0; r < PR; r++) {
            const __m512 b = _mm512_set1_ps(P->q[r * D + d]);
            s[r][0] = _mm512_fmadd_ps(b, k0, s[r][0]);
            s[r][1] = _mm512_fmadd_ps(b, k1, s[r][1]);
            s[r][2] = _mm512_fmadd_ps(b, k2, s[r][2]);
            s[r][3] = _mm512_fmadd_ps(b, k3, s[r][3]);
        }
    }
    float p[PR][BK] __attribute__((aligned(64)));
    float corr[PR];
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < PR; r++) {
        __mmask16 vis[4] = {0xffff, 0xffff, 0xffff, 0xffff};
        if (j0 + BK - 1 > P->limit[r]) { /* the diagonal crosses this tile */
            const __m512i lim = _mm512_set1_epi32((int)(P->limit[r] - j0));
            for (int c = 0; c < 4; c++) {
                vis[c] = _mm512_cmple_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(16 * c)), lim);
                s[r][c] = _mm512_mask_blend_ps(vis[c], neg_inf, s[r][c]);
            }
        }
        const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3])));
        const float mnew = mx > P->m[r] ? mx : P->m[r];
        if (mnew == -INFINITY) { /* nothing visible yet (never for a causal chunk: key 0 is) */
            corr[r] = 1.0f;
            memset(p[r], 0, sizeof(p[r]));
            continue;
        }
        corr[r] = expf(P->m[r] - mnew); /* 0 on the first tile (m = -inf) */
        __m512 sum = _mm512_setzero_ps();
        const __m512 mv = _mm512_set1_ps(mnew);
        for (int c = 0; c < 4; c++) {
            const __m512 e = _mm512_maskz_mov_ps(vis[c], exp512_nonpos(_mm512_sub_ps(s[r][c], mv)));
            _mm512_store_ps(p[r] + 16 * c, e);
            sum = _mm512_add_ps(sum, e);
        }
        P->m[r] = mnew;
        P->l[r] = P->l[r] * corr[r] + _mm512_reduce_add_ps(sum);
    }
    for (int64_t dc = 0; dc < D; dc += 64) {
        __m512 o[PR][4];
#pragma GCC unroll 6
        for (int r = 0; r < PR; r++) {
            const __m512 cr = _mm512_set1_ps(corr[r]);
            for (int c = 0; c < 4; c++) o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(P->o + r * D + dc + 16 * c), cr);
        }
        for (int64_t j = 0; j < BK; j++) {
            const float* vr = vp + j * D + dc;
            const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16), v2 = _mm512_loadu_ps(vr + 32),
                         v3 = _mm512_loadu_ps(vr + 48);
#pragma GCC unroll 6
            for (int r = 0; r < PR; r++) {
                const __m512 b = _mm512_set1_ps(p[r][j]);
                o[r][0] = _mm512_fmadd_ps(b, v0, o[r][0]);
                o[r][1] = _mm512_fmadd_ps(b, v1, o[r][1]);
                o[r][2] = _mm512_fmadd_ps(b, v2, o[r][2]);
                o[r][3] = _mm512_fmadd_ps(b, v3, o[r][3]);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < PR; r++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(P->o + r * D + dc + 16 * c, o[r][c]);
    }
}

int spindle_prefill_attention(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
                              int64_t bs, int64_t nblocks, float* out, float* lse, int64_t n, int64_t p0, int64_t Hq,
                              int64_t Hkv, int64_t D, float scale, int nthreads) {
    if (D % 64 || D > MAXD || Hq % Hkv || n < 1 || p0 < 0 || bs < 1) return -1;
    const int64_t G = Hq / Hkv, total = p0 + n, tiles = (total + BK - 1) / BK;
    for (int64_t b = 0; b < (total + bs - 1) / bs; b++)
        if (table[b] < 0 || table[b] >= nblocks) return -2;
    const int64_t tile_floats = BK * D;
    float* kt = (float*)aligned_alloc(64, (size_t)(Hkv * tiles * tile_floats * 2) * sizeof(float));
    if (!kt) return -3;
    float* vp = kt + Hkv * tiles * tile_floats;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t it = 0; it < Hkv * tiles; it++)
        pack_kv(k_cache, v_cache, table, bs, total, it / tiles, it % tiles, Hkv, D, kt + it * tile_floats,
                vp + it * tile_floats);
    const int64_t rows = n * G, panels_per_head = (rows + PR - 1) / PR;
    /* as many panels per item as keep at least 4 items per thread */
    int64_t per = Hkv * panels_per_head / (4 * (int64_t)nthreads);
    per = per < 1 ? 1 : per > MAX_NP ? MAX_NP : per;
    const int64_t groups = (panels_per_head + per - 1) / per;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        Panel panels[MAX_NP];
        float* buf = (float*)aligned_alloc(64, (size_t)(per * 2 * PR * D) * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t i = 0; buf && i < per; i++) {
            panels[i].q = buf + i * 2 * PR * D;
            panels[i].o = panels[i].q + PR * D;
        }
        /* heaviest groups (latest queries, most keys) first, so the dynamic schedule ends balanced */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < Hkv * groups; it++) {
            if (!buf) continue;
            const int64_t h = it % Hkv, grp = groups - 1 - it / Hkv;
            int64_t np = 0, last = 0;
            for (; np < per; np++) {
                const int64_t r0 = (grp * per + np) * PR;
                if (r0 >= rows) break;
                Panel* P = &panels[np];
                P->rows = rows - r0 < PR ? rows - r0 : PR;
                for (int64_t r = 0; r < PR; r++) {
                    const int64_t rr = r0 + (r < P->rows ? r : 0), t = rr / G, g = rr % G;
                    const float* src = q + (t * Hq + h * G + g) * D;
                    for (int64_t d = 0; d < D; d++) P->q[r * D + d] = src[d] * scale;
                    memset(P->o + r * D, 0, (size_t)D * sizeof(float));
                    P->m[r] = -INFINITY;
                    P->l[r] = 0.0f;
                    P->limit[r] = p0 + t;
                    if (P->limit[r] > last) last = P->limit[r];
                }
            }
            for (int64_t tile = 0; tile * BK <= last; tile++) {
                const float* ktile = kt + (h * tiles + tile) * tile_floats;
                const float* vtile = vp + (h * tiles + tile) * tile_floats;
                for (int64_t i = 0; i < np; i++) {
                    Panel* P = &panels[i];
                    int64_t hi = P->limit[0];
                    for (int r = 1; r < PR; r++) hi = P->limit[r] > hi ? P->limit[r] : hi;
                    if (tile * BK <= hi) panel_tile(P, ktile, vtile, tile * BK, D);
                }
            }
            for (int64_t i = 0; i < np; i++) {
                const Panel* P = &panels[i];
                const int64_t r0 = (grp * per + i) * PR;
                for (int64_t r = 0; r < P->rows; r++) {
                    const int64_t t = (r0 + r) / G, g = (r0 + r) % G, hq = h * G + g;
                    float* dst = out + (t * Hq + hq) * D;
                    const float inv = 1.0f / P->l[r];
                    for (int64_t d = 0; d < D; d++) dst[d] = P->o[r * D + d] * inv;
                    lse[hq * n + t] = P->m[r] + logf(P->l[r]);
                }
            }
        }
        free(buf);
    }
    if (failed) {
        free(kt);
        return -3;
    }
    free(kt);
    return 0;
}
