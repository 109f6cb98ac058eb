/* Dense fp32 weights times a few token rows, y = x·Wᵀ (+ b): a float32 model's decode-sized
   matmuls. Such a step is memory-bound (every weight read once for a few tokens), and torch's
   CPU GEMM does not stream at that shape: on the 2-core AVX2 EPYC, F.linear of one row by the
   embedded model's 49,152 × 576 LM head moved 5.8 GB/s (2.9 for two rows), this kernel 13.5;
   over the model's layers, from memory, it took 1.6-1.7x less time at one row, 2.7-2.9x less
   at 2-4 (engine/cpu_formats.py's probe).

   Per 4 output rows, a pass of up to TOKEN_PASS token rows shares each load of the weights
   (4 rows × TOKEN_PASS tokens of vector sums fill the registers), and the next passes read
   the same rows again from L1 (L2 for rows wider than ~2,000). The passes share the fetch of
   the next 4 rows into the cache (prefetch_bytes), each its own share of their lines, so that
   memory streams them throughout the block rather than in its first pass alone (over the
   embedded model's layers on the Zen 5 EPYC, benchmarks/matmul_ab.py: 1.1-1.2x less time
   at 8-16 token rows, 1.0-1.04x at 24-32; its AVX2 build 1.1-1.2x at 4, 1.3-1.4x at 8-32).
   Each (row, token) dot sums its k terms in the same order whatever the step holds, so a
   row's output does not depend on the batch around it. */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#if defined(__AVX512F__)
#define WIDTH 16
#define TOKEN_PASS 4
#else
#define WIDTH 8
#define TOKEN_PASS 2
#endif
#define ROWS 4 /* output rows per pass */
/* In steps of up to this many token rows the passes share the fetch of the next rows; in
   larger ones the first pass fetches them all (at 40-128 rows, sharing it was no faster on
   the Zen 5 EPYC, or 1-5% slower). */
#define SPREAD_TOKENS 32

typedef float vf __attribute__((vector_size(4 * WIDTH)));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* a·b + c, fused where the CPU fuses it (the build compiles with -ffp-contract=off). */
static inline vf multiply_add(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* out[t * n_out + r] for r < valid, t < TOKENS, of the ROWS weight rows at `weight`; pass
   `fetch_pass` of `fetch_passes` fetches its share of the ROWS rows after them into the cache
   meanwhile (a line per 16 floats, every fetch_passes-th line; none where fetch_passes is 0).
   Called with constants, so the sums stay in registers; `spread` is one too: without it
   (fetch_passes 0 or 1) the loop is the one that fetched in the first pass alone, without
   the share's bookkeeping, which had made 1-row and 64-row steps 1-3% slower. */
static inline __attribute__((always_inline)) void pass(
    const float *weight, int64_t k, const float *x, int64_t x_stride, int tokens, int spread,
    const float *bias, float *out, int64_t n_out, int64_t valid, int64_t fetch_pass,
    int64_t fetch_passes) {
    const float *rows[ROWS];
    for (int r = 0; r < ROWS; r++) rows[r] = weight + (r < valid ? r : 0) * k;
    vf sums[TOKEN_PASS][ROWS];
    for (int t = 0; t < tokens; t++)
        for (int r = 0; r < ROWS; r++) sums[t][r] = (vf){0};
    int64_t c = 0, fetch_at = fetch_passes > 0 ? 16 * fetch_pass : k;
    for (; c + WIDTH <= k; c += WIDTH) {
        vf w[ROWS];
        for (int r = 0; r < ROWS; r++) w[r] = load(rows[r] + c);
        if (spread ? c == fetch_at : fetch_passes > 0 && c % 16 == 0) {
            for (int r = 0; r < ROWS; r++) prefetch_bytes(weight + (ROWS + r) * k + c, 64);
            fetch_at += 16 * fetch_passes;
        }
        for (int t = 0; t < tokens; t++) {
            const vf xv = load(x + t * x_stride + c);
            for (int r = 0; r < ROWS; r++) sums[t][r] = multiply_add(w[r], xv, sums[t][r]);
        }
    }
    for (int t = 0; t < tokens; t++)
        for (int r = 0; r < valid; r++) {
            float sum = 0.0f;
            for (int lane = 0; lane < WIDTH; lane++) sum += sums[t][r][lane];
            for (int64_t j = c; j < k; j++) sum += rows[r][j] * x[t * x_stride + j];
            out[t * n_out + r] = bias != NULL ? sum + bias[r] : sum;
        }
}

/* Per token count: a pass that fetches all of the next rows or none (`fetch_next`), and one
   that fetches its share of them. */
typedef void (*pass_fn)(const float *, int64_t, const float *, int64_t, const float *, float *,
                        int64_t, int64_t, int);
typedef void (*spread_pass_fn)(const float *, int64_t, const float *, int64_t, const float *,
                               float *, int64_t, int64_t, int64_t, int64_t);

#define DEFINE_PASSES(TOKENS)                                                                   \
static void pass_##TOKENS(const float *weight, int64_t k, const float *x, int64_t x_stride,     \
                          const float *bias, float *out, int64_t n_out, int64_t valid,          \
                          int fetch_next) {                                                     \
    pass(weight, k, x, x_stride, TOKENS, 0, bias, out, n_out, valid, 0, fetch_next);            \
}                                                                                               \
static void spread_pass_##TOKENS(const float *weight, int64_t k, const float *x,                \
                                 int64_t x_stride, const float *bias, float *out, int64_t n_out,\
                                 int64_t valid, int64_t fetch_pass, int64_t fetch_passes) {     \
    pass(weight, k, x, x_stride, TOKENS, 1, bias, out, n_out, valid, fetch_pass, fetch_passes); \
}

DEFINE_PASSES(1)
DEFINE_PASSES(2)
#if TOKEN_PASS == 4
DEFINE_PASSES(3)
DEFINE_PASSES(4)
static const pass_fn PASSES[TOKEN_PASS] = {pass_1, pass_2, pass_3, pass_4};
static const spread_pass_fn SPREAD_PASSES[TOKEN_PASS] = {spread_pass_1, spread_pass_2,
                                                         spread_pass_3, spread_pass_4};
#else
static const pass_fn PASSES[TOKEN_PASS] = {pass_1, pass_2};
static const spread_pass_fn SPREAD_PASSES[TOKEN_PASS] = {spread_pass_1, spread_pass_2};
#endif

/* out [num_tokens, n_out] (contiguous) = x [num_tokens, k] (rows x_stride apart) · weightᵀ
   (+ bias [n_out], or NULL); weight [n_out, k] contiguous. Threads take blocks of 4 rows. */
void dense_matmul_f32(const float *weight, const float *bias, int64_t n_out, int64_t k,
                      const float *x, int64_t x_stride, int64_t num_tokens, float *out,
                      int num_threads) {
    const int64_t blocks = (n_out + ROWS - 1) / ROWS;
    const int64_t passes = (num_tokens + TOKEN_PASS - 1) / TOKEN_PASS;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if(n_out * k >= 65536)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t row = block * ROWS;
        const int64_t valid = n_out - row < ROWS ? n_out - row : ROWS;
        /* The next block is fetched where it has all ROWS rows: by the passes together in
           steps of up to SPREAD_TOKENS rows, else by the first. */
        const int fetch = row + 2 * ROWS <= n_out;
        const int spread = fetch && passes > 1 && num_tokens <= SPREAD_TOKENS;
        for (int64_t t = 0; t < num_tokens; t += TOKEN_PASS) {
            const int64_t tokens = num_tokens - t < TOKEN_PASS ? num_tokens - t : TOKEN_PASS;
            const float *row_bias = bias != NULL ? bias + row : NULL;
            if (spread)
                SPREAD_PASSES[tokens - 1](weight + row * k, k, x + t * x_stride, x_stride,
                                          row_bias, out + t * n_out + row, n_out, valid,
                                          t / TOKEN_PASS, passes);
            else
                PASSES[tokens - 1](weight + row * k, k, x + t * x_stride, x_stride, row_bias,
                                   out + t * n_out + row, n_out, valid, fetch && t == 0);
        }
    }
}
