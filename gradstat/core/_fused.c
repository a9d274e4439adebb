/* gradstat's one native kernel: the statistics of an fp32 or bf16 gradient in a single pass,
 * and a guard that turns a mapped file truncated under a reader into an error.
 *
 * Compiled on first use by gradstat/native.py with the machine's C compiler (-O3 -march=native
 * -fopenmp) and cached; without a compiler gradstat uses PyTorch operations instead.
 *
 * Sums are float64 throughout: an fp32 (or bf16) value's square and magnitude are exact in a
 * double, so each element enters its sum exactly, and the only rounding is the float64 additions,
 * in an order this file fixes: a CHUNK is read in rows of one cache line (16 fp32 or 32 bf16
 * elements, element k of a row in lane k), each lane summed over the rows in order and the
 * elements past the last whole row in a sum of their own; then the lanes in order, that sum
 * last, and the chunks in order. No element's sum takes more than 2048 + 32 + chunks additions
 * (that depth times 2^-53 bounds the relative error of a sum of squares or of magnitudes:
 * 2.6e-13 for 1e7 elements), whatever the CPU's vector width: the compiler may not reorder float
 * additions without -ffast-math. They are not free: against fp32 lanes, measured
 * on this project's 2-core CPU, 1.2x on fp32 data read from memory and 1.4x on data in cache.
 * A norm takes one sum alone (gradstat_sum_*), about twice the fused pass's speed on bf16.
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
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define CHUNK 32768    /* elements per double partial, the unit of work of a thread */
#define PARALLEL_CHUNKS 4 /* fewer chunks than this (512 KiB of fp32): no thread team */
#define ROW_BYTES 64   /* a row of lanes is one cache line: 16 fp32 lanes, 32 bf16 lanes */

/* A bf16 value is the upper half of the fp32 with the same bits. */
static inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

#define LOAD_F32(p, i) ((p)[i])
#define LOAD_BF16(p, i) bf16_to_float((p)[i])

/* A row's lanes hold its elements in order, read where they lie. Two other ways were measured
 * on 2026-12-04 (one thread, in cache, GCC 12). Copying a row to a local array first made GCC load
 * fp32 one float at a time (2.7x slower). bf16 rows read as 32-bit words, each word's low half
 * shifted and its high half masked into lanes of their own, summed at 11.5 G elements/s with
 * AVX-512 against 8.6 in element order, but at 1.9 when built for AVX2 (GCC kept the lanes in
 * memory); a kernel must sum in one order on every CPU, so the elements stay in order. */

/* Each row asks for the cache line PREFETCH_BYTES ahead of it: the hardware prefetcher alone kept
 * too few loads in flight. Measured from memory on this project's 2-core CPU (256M elements, two
 * threads): bf16 squares at 4.1 G elements/s without a prefetch, 10.6 with one (PyTorch's
 * vector_norm 5.6); fp32 at 4.4 and 6.7 (PyTorch 3.8). The prefetch was first issued for a
 * whole block of 512 elements at the block's start, and the lanes summed at each block's end;
 * a prefetch per row and lanes kept through the chunk took the bf16 sum over
 * benchmarks/bench_core.py's set from 20.5 to 16.9 ms (a bare read of its bytes: 12.3-17.9 ms,
 * the machine's memory being shared). A prefetch never faults, past a tensor's end or a truncated
 * map's. */
#define PREFETCH_BYTES 2048
static inline void prefetch_row(const void *row) {
    __builtin_prefetch((const char *)row + PREFETCH_BYTES);
}

/* The tensors of a call that take a thread team share one. A team woken per tensor cost its
 * wake-up each time, the more as the pass grew faster: over benchmarks/bench_core.py's bf16 set
 * (297 tensors), 17.6 ms with a team per tensor against 14.1 with threads that never sleep. */
static int takes_team(int64_t n, int32_t threads) {
    return threads > 1 && (n + CHUNK - 1) / CHUNK >= PARALLEL_CHUNKS;
}

/* A chunk of a tensor of a call: the tensor's index and the chunk's first element. */
struct piece {
    int32_t tensor;
    int64_t start;
};

/* The chunks of the tensors among ns[0..count) that take a team, tensor by tensor and in order
 * within each, in *pieces (malloc'ed, NULL when none). Returns their number, or -1 if out of
 * memory. */
static int64_t team_pieces(const int64_t *ns, int32_t count, int32_t threads,
                           struct piece **pieces) {
    int64_t total = 0;
    for (int32_t i = 0; i < count; i++)
        if (takes_team(ns[i], threads)) total += (ns[i] + CHUNK - 1) / CHUNK;
    *pieces = NULL;
    if (total == 0) return 0;
    *pieces = malloc(total * sizeof(struct piece));
    if (*pieces == NULL) return -1;
    int64_t next = 0;
    for (int32_t i = 0; i < count; i++) {
        if (!takes_team(ns[i], threads)) continue;
        for (int64_t start = 0; start < ns[i]; start += CHUNK)
            (*pieces)[next++] = (struct piece){i, start};
    }
    return total;
}

/* A chunk's length, written as the serial loops write it: GCC 12 compiles a chunk's loop from
 * the lengths all its callers pass, and `left < CHUNK ? left : CHUNK` in the serial loops made
 * the sums 15% slower in cache (measured on 2026-12-04). */
static inline int64_t piece_length(const struct piece *piece, const int64_t *ns) {
    const int64_t n = ns[piece->tensor];
    return piece->start + CHUNK < n ? CHUNK : n - piece->start;
}

/* The kernel for one element type: chunk_stats and the exported entry points. */
#define DEFINE_FUSED(NAME, TYPE, LOAD)                                                          \
    /* One chunk of len elements: its sums of squares and of magnitudes, and its zeros and      \
     * peak added to the running ones. */                                                       \
    static void chunk_stats_##NAME(const TYPE *p, int64_t len, double *squares_out,             \
                                   double *magnitudes_out, int64_t *zeros, float *peak) {       \
        enum { LANES = ROW_BYTES / sizeof(TYPE) };                                              \
        double squares[LANES] = {0}, magnitudes[LANES] = {0};                                   \
        float largest[LANES] = {0};                                                             \
        int32_t zero_lanes[LANES] = {0};                                                        \
        int64_t i = 0;                                                                          \
        for (; i + LANES <= len; i += LANES) {                                                  \
            prefetch_row(p + i);                                                                \
            const TYPE *row = p + i;                                                            \
            for (int k = 0; k < LANES; k++) {                                                   \
                const float v = LOAD(row, k), a = fabsf(v);                                     \
                const double wide = a;                                                          \
                squares[k] += wide * wide;                                                      \
                magnitudes[k] += wide;                                                          \
                largest[k] = a > largest[k] ? a : largest[k];                                   \
                zero_lanes[k] += v == 0.0f;                                                     \
            }                                                                                   \
        }                                                                                       \
        double tail_squares = 0.0, tail_magnitudes = 0.0;                                       \
        float m = *peak;                                                                        \
        int64_t z = 0;                                                                          \
        for (; i < len; i++) {                                                                  \
            const float v = LOAD(p, i), a = fabsf(v);                                           \
            const double wide = a;                                                              \
            tail_squares += wide * wide;                                                        \
            tail_magnitudes += wide;                                                            \
            m = a > m ? a : m;                                                                  \
            z += v == 0.0f;                                                                     \
        }                                                                                       \
        double s = 0.0, t = 0.0;                                                                \
        for (int k = 0; k < LANES; k++) {                                                       \
            s += squares[k];                                                                    \
            t += magnitudes[k];                                                                 \
            m = largest[k] > m ? largest[k] : m;                                                \
            z += zero_lanes[k];                                                                 \
        }                                                                                       \
        *squares_out = s + tail_squares;                                                        \
        *magnitudes_out = t + tail_magnitudes;                                                  \
        *zeros += z;                                                                            \
        *peak = m;                                                                              \
    }                                                                                           \
                                                                                                \
    /* One tensor's statistics (see gradstat_fused), its chunks in order on this thread. */     \
    static void serial_stats_##NAME(const TYPE *x, int64_t n, double *sum_squares,              \
                                    double *sum_abs, int64_t *zeros, float *max_abs,            \
                                    int32_t *has_nan) {                                         \
        int64_t zero_count = 0;                                                                 \
        float peak = 0.0f;                                                                      \
        double total = 0.0, total_abs = 0.0;                                                    \
        for (int64_t start = 0; start < n; start += CHUNK) {                                    \
            double squares, magnitudes;                                                         \
            chunk_stats_##NAME(x + start, start + CHUNK < n ? CHUNK : n - start, &squares,      \
                               &magnitudes, &zero_count, &peak);                                \
            total += squares;                                                                   \
            total_abs += magnitudes;                                                            \
        }                                                                                       \
        *sum_squares = total;                                                                   \
        *sum_abs = total_abs;                                                                   \
        *zeros = zero_count;                                                                    \
        *max_abs = peak;                                                                        \
        *has_nan = isnan(total); /* squares are never negative: only a NaN makes a NaN */       \
    }                                                                                           \
                                                                                                \
    /* gradstat_fused for each of count tensors, in one call (a rank file's small tensors: a    \
     * call from Python costs more than such a tensor's pass). The large ones share one team,   \
     * their chunks' sums added tensor by tensor in order, as serial_stats adds them: a tensor  \
     * gets the same bits in any call, at any thread count. Returns 0, or -1 if out of          \
     * memory. */                                                                               \
    int32_t gradstat_fused_many_##NAME(const TYPE *const *xs, const int64_t *ns, int32_t count, \
                                       int32_t threads, double *sum_squares, double *sum_abs,   \
                                       int64_t *zeros, float *max_abs, int32_t *has_nan) {      \
        for (int32_t i = 0; i < count; i++) {                                                   \
            if (!takes_team(ns[i], threads))                                                    \
                serial_stats_##NAME(xs[i], ns[i], sum_squares + i, sum_abs + i, zeros + i,      \
                                    max_abs + i, has_nan + i);                                  \
        }                                                                                       \
        struct piece *pieces;                                                                   \
        const int64_t total = team_pieces(ns, count, threads, &pieces);                         \
        if (total <= 0) return (int32_t)total;                                                  \
        double *sums = malloc(2 * total * sizeof(double));                                      \
        int64_t *piece_zeros = calloc(total, sizeof(int64_t));                                  \
        float *peaks = calloc(total, sizeof(float));                                            \
        if (sums == NULL || piece_zeros == NULL || peaks == NULL) {                             \
            free(pieces); free(sums); free(piece_zeros); free(peaks);                           \
            return -1;                                                                          \
        }                                                                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
        for (int64_t j = 0; j < total; j++) {                                                   \
            chunk_stats_##NAME(xs[pieces[j].tensor] + pieces[j].start,                          \
                               piece_length(pieces + j, ns), sums + j, sums + total + j,        \
                               piece_zeros + j, peaks + j);                                     \
        }                                                                                       \
        for (int64_t j = 0; j < total;) {                                                       \
            const int32_t i = pieces[j].tensor;                                                 \
            double squares = 0.0, magnitudes = 0.0;                                             \
            int64_t zero_count = 0;                                                             \
            float peak = 0.0f;                                                                  \
            for (; j < total && pieces[j].tensor == i; j++) {                                   \
                squares += sums[j];                                                             \
                magnitudes += sums[total + j];                                                  \
                zero_count += piece_zeros[j];                                                   \
                peak = peaks[j] > peak ? peaks[j] : peak;                                       \
            }                                                                                   \
            sum_squares[i] = squares;                                                           \
            sum_abs[i] = magnitudes;                                                            \
            zeros[i] = zero_count;                                                              \
            max_abs[i] = peak;                                                                  \
            has_nan[i] = isnan(squares);                                                        \
        }                                                                                       \
        free(pieces); free(sums); free(piece_zeros); free(peaks);                               \
        return 0;                                                                               \
    }                                                                                           \
                                                                                                \
    /* Over n elements: the sum of squares, the sum of |x|, the number of elements equal to     \
     * zero (-0.0 included), max |x| ignoring NaN, and whether any element is NaN. Returns 0,   \
     * or -1 if out of memory. */                                                               \
    int32_t gradstat_fused_##NAME(const TYPE *x, int64_t n, int32_t threads,                    \
                                  double *sum_squares, double *sum_abs, int64_t *zeros,         \
                                  float *max_abs, int32_t *has_nan) {                           \
        return gradstat_fused_many_##NAME(&x, &n, 1, threads, sum_squares, sum_abs, zeros,      \
                                          max_abs, has_nan);                                    \
    }

DEFINE_FUSED(f32, float, LOAD_F32)
DEFINE_FUSED(bf16, uint16_t, LOAD_BF16)

/* One sum alone, of squares or of magnitudes: the norm's pass, which needs nothing else (the
 * fused pass's zero count, peak and other sum cost it about half its time on bf16). Its lanes,
 * chunks and threads are the fused pass's, added in the same order, so it gives the bits of the
 * fused pass's sum_squares or sum_abs. */
#define SQUARE(v) ((double)(v) * (double)(v)) /* exact, as the fused pass's square of |v| */
#define MAGNITUDE(v) ((double)fabsf(v))

/* The whole rows of a chunk summed into lanes[] by a faster way than the loop of DEFINE_SUM,
 * lane k of a row into lanes[k] in the same order, so with the same bits: returns the number of
 * elements summed, 0 where there is no faster way (lanes[] then untouched). */
static inline int64_t no_faster_rows(const void *p, int64_t len, double *lanes) {
    (void)p, (void)len, (void)lanes;
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
/* bf16 squares on a CPU with AVX2 and no AVX-512 make their doubles with integer operations.
 * There the loop of DEFINE_SUM is bound by its float-to-double conversions (on this project's
 * AMD EPYC, one thread: 4.7 G elements/s in cache, 4.6 from memory, where a bare read of the
 * bytes ran at 6.9 from memory). A bf16 magnitude's 15 bits shifted to the top of a double's
 * exponent and fraction, d, are |x| * 2^-896 exactly, a subnormal bf16 included; the same bits
 * with 1792 added to the exponent, e, are |x| * 2^896 for every normal x, and d * e is x*x
 * exactly: fma(d, e, lane) is the lane's sum with the bits of DEFINE_SUM's. A zero gives
 * 0 * 2^769 = 0, an infinity and a NaN an e that is one (so an infinite or NaN square, as
 * before). Only a subnormal's e is wrong: a chunk holding one is summed again by the loop.
 * 6.7 G elements/s in cache, 6.3 from memory (measured on 2026-12-06). Where there is AVX-512
 * the conversions are not the bound, and that loop stays. */
static int64_t faster_rows_squares_bf16(const void *data, int64_t len, double *lanes) {
    const uint16_t *p = data;
    const __m256i magnitude = _mm256_set1_epi64x(0x7fff);
    const __m256i rebias = _mm256_set1_epi64x((int64_t)1792 << 52);
    const __m256i magnitude16 = _mm256_set1_epi16(0x7fff), one = _mm256_set1_epi16(1);
    __m256i least = _mm256_set1_epi16(-1); /* the least magnitude's bits less one: a zero's wrap */
    __m256d sums[8];
    for (int j = 0; j < 8; j++) sums[j] = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 32 <= len; i += 32) {
        prefetch_row(p + i);
        for (int half = 0; half < 2; half++) {
            const __m256i words = _mm256_loadu_si256((const __m256i *)(p + i + 16 * half));
            const __m256i less_one = _mm256_sub_epi16(_mm256_and_si256(words, magnitude16), one);
            least = _mm256_min_epu16(least, less_one);
        }
        for (int j = 0; j < 8; j++) {
            const __m128i four = _mm_loadl_epi64((const __m128i *)(p + i + 4 * j));
            const __m256i wide = _mm256_cvtepu16_epi64(four);
            const __m256i d = _mm256_slli_epi64(_mm256_and_si256(wide, magnitude), 45);
            const __m256i e = _mm256_add_epi64(d, rebias);
            sums[j] = _mm256_fmadd_pd(_mm256_castsi256_pd(d), _mm256_castsi256_pd(e), sums[j]);
        }
    }
    /* A subnormal's magnitude is 1 .. 0x7f: less one, below 0x7f. */
    const __m256i floor = _mm256_set1_epi16(0x7e);
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi16(_mm256_min_epu16(least, floor), least))) return 0;
    for (int j = 0; j < 8; j++) _mm256_storeu_pd(lanes + 4 * j, sums[j]);
    return i;
}
#else
#define faster_rows_squares_bf16 no_faster_rows
#endif

#define DEFINE_SUM(NAME, TYPE, LOAD, TERM, ROWS)                                                \
    static double chunk_sum_##NAME(const TYPE *p, int64_t len) {                                \
        enum { LANES = ROW_BYTES / sizeof(TYPE) };                                              \
        double lanes[LANES] = {0};                                                              \
        int64_t i = ROWS(p, len, lanes);                                                        \
        for (; i + LANES <= len; i += LANES) {                                                  \
            prefetch_row(p + i);                                                                \
            const TYPE *row = p + i;                                                            \
            for (int k = 0; k < LANES; k++) lanes[k] += TERM(LOAD(row, k));                     \
        }                                                                                       \
        double tail = 0.0;                                                                      \
        for (; i < len; i++) tail += TERM(LOAD(p, i));                                          \
        double s = 0.0;                                                                         \
        for (int k = 0; k < LANES; k++) s += lanes[k];                                          \
        return s + tail;                                                                        \
    }                                                                                           \
                                                                                                \
    /* One tensor's sum, its chunks in order on this thread. */                                 \
    static double serial_sum_##NAME(const TYPE *x, int64_t n) {                                 \
        double total = 0.0;                                                                     \
        for (int64_t start = 0; start < n; start += CHUNK)                                      \
            total += chunk_sum_##NAME(x + start, start + CHUNK < n ? CHUNK : n - start);        \
        return total;                                                                           \
    }                                                                                           \
                                                                                                \
    /* The sum of each of count tensors, in one call, the large ones sharing one team (each     \
     * gets serial_sum's bits, as gradstat_fused_many's sums). Returns 0, or -1 if out of       \
     * memory. */                                                                               \
    int32_t gradstat_sum_many_##NAME(const TYPE *const *xs, const int64_t *ns, int32_t count,   \
                                     int32_t threads, double *out) {                            \
        for (int32_t i = 0; i < count; i++) {                                                   \
            if (!takes_team(ns[i], threads)) out[i] = serial_sum_##NAME(xs[i], ns[i]);          \
        }                                                                                       \
        struct piece *pieces;                                                                   \
        const int64_t total = team_pieces(ns, count, threads, &pieces);                         \
        if (total <= 0) return (int32_t)total;                                                  \
        double *sums = malloc(total * sizeof(double));                                          \
        if (sums == NULL) {                                                                     \
            free(pieces);                                                                       \
            return -1;                                                                          \
        }                                                                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
        for (int64_t j = 0; j < total; j++) {                                                   \
            sums[j] = chunk_sum_##NAME(xs[pieces[j].tensor] + pieces[j].start,                  \
                                       piece_length(pieces + j, ns));                           \
        }                                                                                       \
        for (int64_t j = 0; j < total;) {                                                       \
            const int32_t i = pieces[j].tensor;                                                 \
            double sum = 0.0;                                                                   \
            for (; j < total && pieces[j].tensor == i; j++) sum += sums[j];                     \
            out[i] = sum;                                                                       \
        }                                                                                       \
        free(pieces); free(sums);                                                               \
        return 0;                                                                               \
    }                                                                                           \
                                                                                                \
    /* Over n elements: the sum into *out. Returns 0, or -1 if out of memory. */                \
    int32_t gradstat_sum_##NAME(const TYPE *x, int64_t n, int32_t threads, double *out) {       \
        return gradstat_sum_many_##NAME(&x, &n, 1, threads, out);                               \
    }

DEFINE_SUM(squares_f32, float, LOAD_F32, SQUARE, no_faster_rows)
DEFINE_SUM(squares_bf16, uint16_t, LOAD_BF16, SQUARE, faster_rows_squares_bf16)
DEFINE_SUM(abs_f32, float, LOAD_F32, MAGNITUDE, no_faster_rows)
DEFINE_SUM(abs_bf16, uint16_t, LOAD_BF16, MAGNITUDE, no_faster_rows)

/* The guard of mapped files (see gradstat/snapshot/container.py).
 *
 * A page of a mapped file that a truncation cut off faults with SIGBUS when it is touched, in
 * whatever code touches it: this kernel, PyTorch's operations, a copy. While a map is guarded,
 * a SIGBUS at an address inside it is answered by mapping zero pages from the faulting page to
 * the map's end (mmap is a plain system call, safe in a handler) and marking the guard; the
 * faulting instruction then reads zeros and the code around it runs on to its end, unwound by
 * nothing (a longjmp out of PyTorch's C++ or out of an OpenMP team would not be safe). Whoever
 * released the guard learns that the file changed, and discards what it computed. A SIGBUS
 * anywhere else goes to the handler there was before, or ends the process as it would have.
 * The handler is installed while at least one map is guarded, and the one before restored
 * after.
 */
#define GUARDS 64

static struct {
    uintptr_t start, end; /* the map: [start, end), end rounded up to whole pages */
    int32_t active, faulted;
} guards[GUARDS];
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
static int32_t guards_held = 0;
static uintptr_t page_bytes; /* read before the handler is installed: sysconf is not for it */
static struct sigaction before;

static void on_sigbus(int signal_number, siginfo_t *info, void *context) {
    const uintptr_t address = (uintptr_t)info->si_addr;
    for (int i = 0; i < GUARDS; i++) {
        if (!__atomic_load_n(&guards[i].active, __ATOMIC_ACQUIRE)) continue;
        if (address < guards[i].start || address >= guards[i].end) continue;
        const int saved_errno = errno;
        const uintptr_t page = address & ~(page_bytes - 1);
        void *zeros = mmap((void *)page, guards[i].end - page, PROT_READ,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        errno = saved_errno;
        if (zeros == MAP_FAILED) break;
        __atomic_store_n(&guards[i].faulted, 1, __ATOMIC_RELEASE);
        return;
    }
    if (before.sa_flags & SA_SIGINFO) {
        if (before.sa_sigaction != NULL) {
            before.sa_sigaction(signal_number, info, context);
            return;
        }
    } else if (before.sa_handler != SIG_DFL && before.sa_handler != SIG_IGN) {
        before.sa_handler(signal_number);
        return;
    }
    /* No handler before: the default action, when the fault happens again on return. */
    struct sigaction fallback;
    memset(&fallback, 0, sizeof fallback);
    fallback.sa_handler = SIG_DFL;
    sigaction(SIGBUS, &fallback, NULL);
}

/* Guard the map of length bytes at start. Returns the guard's number, or -1 when every guard
 * is taken or the handler cannot be installed (the map is then unguarded). */
int32_t gradstat_guard_map(const void *start, int64_t length) {
    int32_t found = -1;
    pthread_mutex_lock(&guard_lock);
    if (page_bytes == 0) page_bytes = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t page = page_bytes;
    for (int i = 0; i < GUARDS && found < 0; i++) {
        if (!guards[i].active) found = i;
    }
    if (found >= 0 && guards_held == 0) {
        struct sigaction ours;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_sigbus;
        ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
        sigemptyset(&ours.sa_mask);
        if (sigaction(SIGBUS, &ours, &before) != 0) found = -1;
    }
    if (found >= 0) {
        guards[found].start = (uintptr_t)start;
        guards[found].end = ((uintptr_t)start + (uintptr_t)length + page - 1) & ~(page - 1);
        guards[found].faulted = 0;
        __atomic_store_n(&guards[found].active, 1, __ATOMIC_RELEASE);
        guards_held++;
    }
    pthread_mutex_unlock(&guard_lock);
    return found;
}

/* Release guard number guard; returns 1 if a page of its map faulted meanwhile, else 0. */
int32_t gradstat_guard_release(int32_t guard) {
    if (guard < 0 || guard >= GUARDS) return 0;
    pthread_mutex_lock(&guard_lock);
    __atomic_store_n(&guards[guard].active, 0, __ATOMIC_RELEASE);
    const int32_t faulted = __atomic_load_n(&guards[guard].faulted, __ATOMIC_ACQUIRE);
    if (--guards_held == 0) {
        struct sigaction now;
        /* Restore the handler before ours, unless someone replaced ours meanwhile. */
        if (sigaction(SIGBUS, NULL, &now) == 0 && (now.sa_flags & SA_SIGINFO) &&
            now.sa_sigaction == on_sigbus)
            sigaction(SIGBUS, &before, NULL);
    }
    pthread_mutex_unlock(&guard_lock);
    return faulted;
}
