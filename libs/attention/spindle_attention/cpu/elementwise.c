/* Row-wise operators of a prefill step, in one pass each and split over threads by rows: RMSNorm, and
 * SiLU(gate) * up of the fused gate/up projection. The torch path runs RMSNorm as five passes (pow, mean, rsqrt,
 * two muls) and SiLU * up as two. The row functions are the decode kernel's (kernels.h), so a row is computed
 * the same way whatever the batch.
 */
#include "kernels.h"

static int64_t rows_per_thread(int64_t T, int nthreads) { return (T + nthreads - 1) / nthreads; }

void spindle_rms_norm(const float* x, const float* w, float* y, int64_t T, int64_t H, float eps, int nthreads) {
    const int64_t per = rows_per_thread(T, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        const int64_t lo = t * per, hi = lo + per < T ? lo + per : T;
        if (lo < hi) rms_norm(x + lo * H, w, y + lo * H, hi - lo, H, eps);
    }
}

void spindle_silu_mul(const float* gu, float* act, int64_t T, int64_t F, int nthreads) {
    const int64_t per = rows_per_thread(T, nthreads);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = 0; t < nthreads; t++) {
        const int64_t lo = t * per, hi = lo + per < T ? lo + per : T;
        if (lo < hi) silu_mul(gu + lo * 2 * F, act + lo * F, hi - lo, F);
    }
}
