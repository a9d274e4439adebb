/* gradstat's one native kernel: the statistics of an fp32 or bf16 gradient in a single pass.
 *
 * Compiled on first use by gradstat/native.py with the machine's C compiler (-O3 -march=native
 * -fopenmp) and cached; without a compiler gradstat uses PyTorch operations instead.
 *
 * The result does not depend on the number of threads: every chunk of CHUNK elements is summed
 * in order into its own double, and the chunks are added in order at the end. native.py loads
 * this OpenMP runtime with a passive wait policy, so that its idle threads sleep instead of
 * spinning on the cores PyTorch's threads need.
 *
 * Tensors of fewer than PARALLEL_CHUNKS chunks are summed by the calling thread alone, with the
 * same chunks in the same order (so the same bits): waking a team costs more than such a tensor
 * takes, the more so when other processes hold the cores (40,000 tensors of 8 elements with one
 * core of two busy: a team per tensor made `gradstat zeros` 5.0x slower than with the kernel
 * off, 1.0x without).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 512      /* elements per fp32 partial sum, as in kernels.ROW */
#define LANES 16       /* independent accumulators per block, so the loop vectorizes */
#define CHUNK 32768    /* elements per double partial, the unit of work of a thread */
#define PARALLEL_CHUNKS 4 /* fewer chunks than this (512 KiB of fp32): no thread team */

/* A bf16 value is the upper half of the fp32 with the same bits. */
static inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_float((p)[i])

/* The kernel for one element type: block_stats, chunk_stats and the exported entry point. */
#define DEFINE_FUSED(NAME, TYPE, LOAD)                                                          \
    static void block_stats_##NAME(const TYPE *p, int64_t len, float *squares_out,             \
                                   int32_t *zeros_out, float *peak_out, int32_t *nan_out) {    \
        float squares[LANES] = {0}, largest[LANES] = {0};                                      \
        int32_t zero_lanes[LANES] = {0}, nan_lanes[LANES] = {0};                               \
        int64_t i = 0;                                                                          \
        for (; i + LANES <= len; i += LANES) {                                                  \
            for (int k = 0; k < LANES; k++) {                                                   \
                const float v = LOAD(p, i + k), a = fabsf(v);                                   \
                squares[k] += v * v;                                                            \
                largest[k] = a > largest[k] ? a : largest[k];                                   \
                zero_lanes[k] += v == 0.0f;                                                     \
                nan_lanes[k] |= v != v;                                                         \
            }                                                                                   \
        }                                                                                       \
        for (; i < len; i++) {                                                                  \
            const float v = LOAD(p, i), a = fabsf(v);                                           \
            squares[0] += v * v;                                                                \
            largest[0] = a > largest[0] ? a : largest[0];                                       \
            zero_lanes[0] += v == 0.0f;                                                         \
            nan_lanes[0] |= v != v;                                                             \
        }                                                                                       \
        float s = 0.0f, m = 0.0f;                                                               \
        int32_t z = 0, q = 0;                                                                   \
        for (int k = 0; k < LANES; k++) {                                                       \
            s += squares[k];                                                                    \
            m = largest[k] > m ? largest[k] : m;                                                \
            z += zero_lanes[k];                                                                 \
            q |= nan_lanes[k];                                                                  \
        }                                                                                       \
        *squares_out = s;                                                                       \
        *zeros_out = z;                                                                         \
        *peak_out = m;                                                                          \
        *nan_out = q;                                                                           \
    }                                                                                           \
                                                                                                \
    /* One chunk, [start, end), in blocks of BLOCK: its sum of squares in double, added to the  \
     * running zero count, peak and NaN flag. */                                                \
    static double chunk_stats_##NAME(const TYPE *x, int64_t start, int64_t end, int64_t *zeros, \
                                     float *peak, int32_t *nan_seen) {                          \
        double sum = 0.0;                                                                       \
        for (int64_t begin = start; begin < end; begin += BLOCK) {                              \
            const int64_t len = begin + BLOCK < end ? BLOCK : end - begin;                      \
            float squares, block_peak;                                                          \
            int32_t block_zeros, block_nan;                                                     \
            block_stats_##NAME(x + begin, len, &squares, &block_zeros, &block_peak, &block_nan); \
            sum += (double)squares;                                                             \
            *zeros += block_zeros;                                                              \
            *peak = block_peak > *peak ? block_peak : *peak;                                    \
            *nan_seen |= block_nan;                                                             \
        }                                                                                       \
        return sum;                                                                             \
    }                                                                                           \
                                                                                                \
    /* Over n elements: the sum of squares, the number of elements equal to zero (-0.0          \
     * included), max |x| ignoring NaN, and whether any element is NaN. Returns 0, or -1 if     \
     * out of memory. */                                                                        \
    int32_t gradstat_fused_##NAME(const TYPE *x, int64_t n, int32_t threads,                    \
                                  double *sum_squares, int64_t *zeros, float *max_abs,          \
                                  int32_t *has_nan) {                                           \
        const int64_t chunks = (n + CHUNK - 1) / CHUNK;                                         \
        int64_t zero_count = 0;                                                                 \
        float peak = 0.0f;                                                                      \
        int32_t nan_seen = 0;                                                                   \
        double total = 0.0;                                                                     \
        if (chunks < PARALLEL_CHUNKS || threads <= 1) {                                         \
            for (int64_t chunk = 0; chunk < chunks; chunk++) {                                  \
                const int64_t start = chunk * CHUNK;                                            \
                const int64_t end = start + CHUNK < n ? start + CHUNK : n;                      \
                total += chunk_stats_##NAME(x, start, end, &zero_count, &peak, &nan_seen);      \
            }                                                                                   \
        } else {                                                                                \
            double *chunk_sums = malloc(chunks * sizeof(double));                               \
            if (chunk_sums == NULL) return -1;                                                  \
            _Pragma("omp parallel for num_threads(threads) schedule(static) reduction(+ : zero_count) reduction(max : peak) reduction(| : nan_seen)") \
            for (int64_t chunk = 0; chunk < chunks; chunk++) {                                  \
                const int64_t start = chunk * CHUNK;                                            \
                const int64_t end = start + CHUNK < n ? start + CHUNK : n;                      \
                chunk_sums[chunk] =                                                             \
                    chunk_stats_##NAME(x, start, end, &zero_count, &peak, &nan_seen);           \
            }                                                                                   \
            for (int64_t chunk = 0; chunk < chunks; chunk++) total += chunk_sums[chunk];        \
            free(chunk_sums);                                                                   \
        }                                                                                       \
        *sum_squares = total;                                                                   \
        *zeros = zero_count;                                                                    \
        *max_abs = peak;                                                                        \
        *has_nan = nan_seen;                                                                    \
        return 0;                                                                               \
    }                                                                                           \
                                                                                                \
    /* The same for each of count tensors, in one call (a rank file's small tensors: a call     \
     * from Python costs more than such a tensor's pass). Returns 0, or -1 if out of memory. */ \
    int32_t gradstat_fused_many_##NAME(const TYPE *const *xs, const int64_t *ns, int32_t count, \
                                       int32_t threads, double *sum_squares, int64_t *zeros,    \
                                       float *max_abs, int32_t *has_nan) {                      \
        for (int32_t i = 0; i < count; i++) {                                                   \
            if (gradstat_fused_##NAME(xs[i], ns[i], threads, sum_squares + i, zeros + i,        \
                                      max_abs + i, has_nan + i) != 0)                           \
                return -1;                                                                      \
        }                                                                                       \
        return 0;                                                                               \
    }

DEFINE_FUSED(f32, float, LOAD_F32)
DEFINE_FUSED(bf16, uint16_t, LOAD_BF16)
