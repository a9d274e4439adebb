/* gradstat's one native kernel: the statistics of an fp32 gradient in a single pass.
 *
 * Compiled on first use by gradstat/native.py with the machine's C compiler (-O3 -march=native
 * -fopenmp) and cached; without a compiler gradstat uses PyTorch operations instead.
 */
#include <math.h>
#include <stdint.h>

#define BLOCK 512 /* elements per fp32 partial sum, as in kernels.ROW */
#define LANES 16  /* independent accumulators per block, so the loop vectorizes */

/* Over n floats: the sum of squares (fp32 within 512-element blocks, blocks added in double),
 * the number of elements equal to zero (-0.0 included), max |x| ignoring NaN, and whether any
 * element is NaN. */
void gradstat_fused_f32(const float *x, int64_t n, int32_t threads, double *sum_squares,
                        int64_t *zeros, float *max_abs, int32_t *has_nan) {
    double total = 0.0;
    int64_t zero_count = 0;
    float peak = 0.0f;
    int32_t nan_seen = 0;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) \
    reduction(+ : total, zero_count) reduction(max : peak) reduction(| : nan_seen)
    for (int64_t block = 0; block < blocks; block++) {
        const float *p = x + block * BLOCK;
        const int64_t len = block == blocks - 1 ? n - block * BLOCK : BLOCK;
        float squares[LANES] = {0}, largest[LANES] = {0};
        int32_t zero_lanes[LANES] = {0}, nan_lanes[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= len; i += LANES) {
            for (int k = 0; k < LANES; k++) {
                const float v = p[i + k], a = fabsf(v);
                squares[k] += v * v;
                largest[k] = a > largest[k] ? a : largest[k];
                zero_lanes[k] += v == 0.0f;
                nan_lanes[k] |= v != v;
            }
        }
        for (; i < len; i++) {
            const float v = p[i], a = fabsf(v);
            squares[0] += v * v;
            largest[0] = a > largest[0] ? a : largest[0];
            zero_lanes[0] += v == 0.0f;
            nan_lanes[0] |= v != v;
        }
        float block_squares = 0.0f, block_peak = 0.0f;
        int32_t block_zeros = 0, block_nan = 0;
        for (int k = 0; k < LANES; k++) {
            block_squares += squares[k];
            block_peak = largest[k] > block_peak ? largest[k] : block_peak;
            block_zeros += zero_lanes[k];
            block_nan |= nan_lanes[k];
        }
        total += (double)block_squares;
        zero_count += block_zeros;
        peak = block_peak > peak ? block_peak : peak;
        nan_seen |= block_nan;
    }
    *sum_squares = total;
    *zeros = zero_count;
    *max_abs = peak;
    *has_nan = nan_seen;
}
