/* GGUF-quantized weights (Q4_0, Q4_1, Q8_0: blocks of 32 weights with an fp16 scale d and,
   for Q4_1, an fp16 minimum m) multiplied natively, for the few token rows of a decode step:
   y = x·Wᵀ.

   The weights are laid out at load (models/packed.py) for this kernel: 16 output rows side by
   side, so one vector holds the same input column of 16 rows (of 8 where vectors are
   narrower than AVX-512's: a group is then taken in two halves). Per column the codes are
   widened to fp32 once and multiplied into every token's accumulators (a broadcast activation);
   per 32-column group the sums are scaled: Σ_g d·(q·x) + m·Σx. The weights are exactly the
   dequantized ones (d·q + m, d·(q − 8), d·q) and the sums fp32, so results equal the
   dequantized fp32 matrix's up to the order of the sums. Output row groups are spread over
   OpenMP threads. Callers guarantee k is a positive multiple of 32 (GGUF blocks).

   Layout, for n16 = ⌈rows / 16⌉ row groups and g = columns / 32 column groups:
   Q4: codes [n16, g, 16, 16] bytes: byte (j, r) is the block's byte j of row r (weight j in
       its low nibble, weight j + 16 in its high one); scales [n16, g, 2, 16] fp16: d, then m.
   Q8_0: codes [n16, g, 8, 16, 4] int8: for each quad of columns, each row's 4 codes
       together (one int32 lane, sign-extended by shifts: cheaper than a widening shuffle
       per column, 1.6x on the LM head); scales [n16, g, 16] fp16 d. */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "element_types.h"
#include "kernels.h"

#if defined(__clang__)
#pragma clang fp contract(fast)
#else
#pragma GCC optimize("fp-contract=fast") /* the library's flags forbid FMA for RoPE's sake */
#endif

#define BLOCK 32
#define LANES 16

/* The lanes of one vector. AVX-512 holds a row group's 16 rows in one register; elsewhere a
   group is taken in two halves of 8 rows, so that AVX2's sixteen 256-bit registers hold four
   token rows' sums (16-lane sums there are register pairs, and past one token row GCC spilled
   them to the stack: two rows cost 5x one). */
#if defined(__AVX512F__)
#define WIDTH 16
#define PASS_ROWS 8
#else
#define WIDTH 8
#define PASS_ROWS 4
#endif

typedef float vf __attribute__((vector_size(4 * WIDTH)));
typedef int32_t vi __attribute__((vector_size(4 * WIDTH)));
typedef uint32_t vu __attribute__((vector_size(4 * WIDTH)));
typedef uint8_t vu8 __attribute__((vector_size(WIDTH)));

/* WIDTH bytes or fp16 widened to WIDTH lanes (GCC scalarizes __builtin_convertvector's
   widening, so the x86 instructions where there are any). */
static inline vi widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vu8 v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, vi);
#endif
}

static inline vf widen_f16(const uint16_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && defined(__AVX__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf r;
    for (int i = 0; i < WIDTH; i++) r[i] = f16_load(p[i]);
    return r;
#endif
}

/* WIDTH of a row group's 16 output rows, from `lane` on, for TOKENS rows of x [TOKENS, k]
   (contiguous fp32), with each column group's sum of x in sums [TOKENS, k / 32];
   out[t * n_out + r] for the `valid` rows. Called with constants, so the loops unroll into
   registers. */
static inline __attribute__((always_inline)) void row_lanes(
    const uint8_t *codes, const uint16_t *scales, int64_t k, int quant_type, const float *x,
    const float *sums, int tokens, float *out, int64_t n_out, int64_t valid, int lane,
    int fetch_next) {
    const int64_t groups = k / BLOCK;
    vf acc[8];
    for (int t = 0; t < tokens; t++) acc[t] = (vf){0};
    for (int64_t g = 0; g < groups; g++) {
        if (fetch_next) prefetch_next_row_group(codes, scales, groups, g, quant_type);
        vf part[8][2];
        for (int t = 0; t < tokens; t++) part[t][0] = part[t][1] = (vf){0};
        if (quant_type == Q8_0) {
            /* Four columns a load: each row's int32 lane holds its codes of columns 4q..4q+3. */
            const uint8_t *quads = codes + g * BLOCK * LANES + 4 * lane;
            for (int q = 0; q < BLOCK / 4; q++) {
                vu four;
                memcpy(&four, quads + q * 4 * LANES, sizeof four);
                /* Shift the code to the top byte, then back down with its sign. */
                const vf w[4] = {__builtin_convertvector((vi)(four << 24) >> 24, vf),
                                 __builtin_convertvector((vi)(four << 16) >> 24, vf),
                                 __builtin_convertvector((vi)(four << 8) >> 24, vf),
                                 __builtin_convertvector((vi)four >> 24, vf)};
                for (int c = 0; c < 4; c++)
                    for (int t = 0; t < tokens; t++)
                        part[t][c & 1] += w[c] * x[t * k + g * BLOCK + 4 * q + c];
            }
            const vf d = widen_f16(scales + g * LANES + lane);
            for (int t = 0; t < tokens; t++) acc[t] += (part[t][0] + part[t][1]) * d;
        } else {
            const uint8_t *column = codes + g * (BLOCK / 2) * LANES + lane;
            for (int j = 0; j < BLOCK / 2; j++) {
                const vi both = widen_u8(column + j * LANES);
                const vf low = __builtin_convertvector(both & 15, vf);
                const vf high = __builtin_convertvector(both >> 4, vf);
                for (int t = 0; t < tokens; t++) {
                    const float *xg = x + t * k + g * BLOCK;
                    part[t][0] += low * xg[j];
                    part[t][1] += high * xg[j + BLOCK / 2];
                }
            }
            const vf d = widen_f16(scales + g * 2 * LANES + lane);
            const vf m = widen_f16(scales + g * 2 * LANES + LANES + lane);
            for (int t = 0; t < tokens; t++)
                acc[t] += (part[t][0] + part[t][1]) * d + m * sums[t * groups + g];
        }
    }
    for (int t = 0; t < tokens; t++) {
        if (valid == WIDTH)
            memcpy(out + t * n_out, &acc[t], sizeof acc[t]);
        else
            for (int64_t r = 0; r < valid; r++) out[t * n_out + r] = acc[t][r];
    }
}

/* One row group (16 output rows), its lanes a vector at a time; `valid` of them exist; with
   `fetch_next`, the next group's weights into the cache meanwhile. */
static inline __attribute__((always_inline)) void row_group(
    const uint8_t *codes, const uint16_t *scales, int64_t k, int quant_type, const float *x,
    const float *sums, int tokens, float *out, int64_t n_out, int64_t valid, int fetch_next) {
    for (int lane = 0; lane < LANES && lane < valid; lane += WIDTH)
        row_lanes(codes, scales, k, quant_type, x, sums, tokens, out + lane, n_out,
                  valid - lane < WIDTH ? valid - lane : WIDTH, lane, fetch_next && lane == 0);
}

#define DEFINE_ROWS(NAME, QUANT_TYPE, TOKENS)                                                   \
static void NAME(const uint8_t *codes, const uint16_t *scales, int64_t n_out, int64_t k,        \
                 const float *x, const float *sums, float *out, int num_threads) {              \
    const int64_t row_groups = (n_out + LANES - 1) / LANES, groups = k / BLOCK;                 \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if(n_out * k >= 65536)")\
    for (int64_t n = 0; n < row_groups; n++)                                                    \
        row_group(codes + n * groups * block_code_bytes(QUANT_TYPE),                            \
                  scales + n * groups * block_scale_count(QUANT_TYPE), k, QUANT_TYPE, x,        \
                  sums, TOKENS, out + n * LANES, n_out,                                         \
                  n_out - n * LANES < LANES ? n_out - n * LANES : LANES, n + 1 < row_groups);   \
}

DEFINE_1_TO_8(DEFINE_ROWS, rows_q4, Q4)
DEFINE_1_TO_8(DEFINE_ROWS, rows_q8_0, Q8_0)

typedef void (*rows_fn)(const uint8_t *, const uint16_t *, int64_t, int64_t, const float *,
                        const float *, float *, int);

/* Narrower builds call the first PASS_ROWS of each. */
static const rows_fn ROWS_BY_TYPE[2][8] = {TABLE_1_TO_8(rows_q4), TABLE_1_TO_8(rows_q8_0)};

/* out [num_tokens, n_out] = x [num_tokens, k] · Wᵀ, all fp32 and contiguous; k a multiple
   of 32. Also the fused decode forward's matmul. */
void packed_matmul(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                   int64_t n_out, int64_t k, const float *x, int64_t num_tokens, float *out,
                   int num_threads) {
    const int64_t groups = k / BLOCK;
    float sums[PASS_ROWS * groups];
    for (int64_t t = 0; t < num_tokens; t += PASS_ROWS) {
        const int64_t tokens = num_tokens - t < PASS_ROWS ? num_tokens - t : PASS_ROWS;
        for (int64_t i = 0; quant_type != Q8_0 && i < tokens * groups; i++) {
            float sum = 0.0f;
            for (int j = 0; j < BLOCK; j++) sum += x[t * k + i * BLOCK + j];
            sums[i] = sum;
        }
        ROWS_BY_TYPE[quant_type][tokens - 1](codes, scales, n_out, k, x + t * k, sums,
                                             out + t * n_out, num_threads);
    }
}

typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    int64_t quant_type, n_out, k;
    const float *x, *sums;
    float *out;
} one_row;

/* Row group n of one_row's product. */
static void one_row_group(const void *context, int64_t n) {
    const one_row *a = context;
    const int64_t groups = a->k / BLOCK;
    const int64_t valid = a->n_out - n * LANES < LANES ? a->n_out - n * LANES : LANES;
    const int fetch_next = (n + 1) * LANES < a->n_out;
    if (a->quant_type == Q8_0) /* constant quant types: row_group inlines for each */
        row_group(a->codes + n * groups * block_code_bytes(Q8_0),
                  a->scales + n * groups * block_scale_count(Q8_0), a->k, Q8_0, a->x, a->sums, 1,
                  a->out + n * LANES, a->n_out, valid, fetch_next);
    else
        row_group(a->codes + n * groups * block_code_bytes(Q4),
                  a->scales + n * groups * block_scale_count(Q4), a->k, Q4, a->x, a->sums, 1,
                  a->out + n * LANES, a->n_out, valid, fetch_next);
}

/* One token row x [k] times the matrix as packed_matmul computes it (out [n_out]), and in
   *token the first index of its largest product, as argmax_rows finds it (row_groups_argmax).
   A greedy batch-1 step's separate pass over its logits (49,152 of the embedded model) read
   half of them from the other core's cache, after a Python call. */
void packed_matmul_argmax(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                          int64_t n_out, int64_t k, const float *x, float *out, int64_t *token,
                          int num_threads) {
    const int64_t groups = k / BLOCK;
    float sums[groups];
    for (int64_t g = 0; quant_type != Q8_0 && g < groups; g++) {
        float sum = 0.0f;
        for (int j = 0; j < BLOCK; j++) sum += x[g * BLOCK + j];
        sums[g] = sum;
    }
    const one_row args = {codes, scales, quant_type, n_out, k, x, sums, out};
    *token = row_groups_argmax(n_out, LANES, out, one_row_group, &args, num_threads);
}

/* The same for x [num_tokens, k] of element type T with a row stride, out contiguous T
   (through fp32 copies, unless T is fp32 and x contiguous); int8_activations: through
   packed_matmul_int8.c. Returns -1 where the copies cannot be allocated, else 0. */
#define DEFINE_PACKED_MATMUL(NAME, T, LOAD, STORE)                                              \
int NAME(const uint8_t *codes, const uint16_t *scales, int64_t quant_type, int64_t n_out,       \
         int64_t k, const T *x, int64_t x_stride, int64_t num_tokens, T *out,                   \
         int64_t int8_activations, int num_threads) {                                           \
    if (sizeof(T) == sizeof(float) && x_stride == k) /* fp32 and contiguous: no copies */       \
        return int8_activations                                                                 \
                   ? packed_matmul_int8(codes, scales, quant_type, n_out, k, (const float *)x,  \
                                        num_tokens, (float *)out, num_threads)                  \
                   : (packed_matmul(codes, scales, quant_type, n_out, k, (const float *)x,      \
                                    num_tokens, (float *)out, num_threads), 0);                 \
    float *x32 = malloc(sizeof(float) * num_tokens * (k + n_out));                              \
    if (x32 == NULL) return -1;                                                                 \
    float *out32 = x32 + num_tokens * k;                                                        \
    for (int64_t t = 0; t < num_tokens; t++)                                                    \
        for (int64_t j = 0; j < k; j++) x32[t * k + j] = LOAD(x[t * x_stride + j]);             \
    int status = 0;                                                                             \
    if (int8_activations)                                                                       \
        status = packed_matmul_int8(codes, scales, quant_type, n_out, k, x32, num_tokens,       \
                                    out32, num_threads);                                        \
    else                                                                                        \
        packed_matmul(codes, scales, quant_type, n_out, k, x32, num_tokens, out32,              \
                      num_threads);                                                             \
    for (int64_t i = 0; status == 0 && i < num_tokens * n_out; i++) out[i] = STORE(out32[i]);   \
    free(x32);                                                                                  \
    return status;                                                                              \
}

DEFINE_PACKED_MATMUL(packed_matmul_f32, float, f32_load, f32_store)
DEFINE_PACKED_MATMUL(packed_matmul_bf16, uint16_t, bf16_load, bf16_store)
