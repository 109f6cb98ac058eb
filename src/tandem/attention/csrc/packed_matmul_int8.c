/* The packed GGUF matrices (packed_matmul.c's layout) multiplied with int8 activations, for
   steps of many token rows, where the fp32 kernel's cost per row (one FMA per weight and
   token) makes a dense bf16 GEMM win: y = x·Wᵀ.

   Each token row is quantized per 32-column block as llama.cpp's Q8_0 activations are:
   d_x = max|x| / 127, q_x = round(x / d_x). A block's dot product is then an integer sum,
   four code pairs per lane per instruction (AVX-512 VNNI), scaled once per block:
     Q4 (w = d·q + m, q in 0..15):   d·d_x·Σ q·q_x + m·d_x·Σ q_x
     Q8_0 (w = d·q, q in −127..127): d·d_x·Σ q·q_x
   The integer sums are exact and each row's result depends on its own activations only, so
   a row's output does not depend on the batch around it. The error is the activations'
   rounding (≤ d_x / 2 per element), as in llama.cpp; models/packed.py keeps this path for the
   step sizes the probe (engine/cpu_formats.py) found it fastest at.

   On x86 with AVX-512 VNNI and VBMI: per 16-row group and 32-column block the codes are put
   into VNNI order once (Q4: one byte permute per 64 bytes, then nibble masks; Q8_0 is stored
   in it) and reused by up to 8 token rows held in registers. Elsewhere a plain C loop gives
   the same sums (tests build both). */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "element_types.h"
#include "kernels.h"

#define BLOCK 32
#define LANES 16
#define MAX_ROWS 8 /* token rows per pass over a row group's codes */

#if defined(__clang__)
#define UNROLL _Pragma("clang loop unroll(full)")
#else
#define UNROLL _Pragma("GCC unroll 8") /* keeps each token's sums in registers */
#endif

enum { Q4 = 0, Q8_0 = 1 };

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define VNNI 1
#else
#define VNNI 0
#endif

/* Whether this build has the vector path (elsewhere the plain C loop is far slower than the
   fp32-activation kernel, and the probe does not offer int8). */
int packed_matmul_int8_vectorized(void) { return VNNI; }

/* x [k] to codes [k] and, per 32-column block, d_x and d_x·Σ q_x. Rounds to nearest even
   either way (the vector conversion under the default rounding mode, nearbyintf). */
static void quantize_row(const float *x, int64_t k, int8_t *codes, float *scales, float *sums) {
    for (int64_t g = 0; g < k / BLOCK; g++) {
        const float *block = x + g * BLOCK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 low = _mm512_loadu_ps(block), high = _mm512_loadu_ps(block + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low),
                                                               _mm512_abs_ps(high)));
        const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i q_low = _mm512_cvtps_epi32(_mm512_mul_ps(low, _mm512_set1_ps(inverse)));
        const __m512i q_high = _mm512_cvtps_epi32(_mm512_mul_ps(high, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i *)(codes + g * BLOCK), _mm512_cvtepi32_epi8(q_low));
        _mm_storeu_si128((__m128i *)(codes + g * BLOCK + 16), _mm512_cvtepi32_epi8(q_high));
        const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
#else
        float amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) /* not fmaxf: GCC calls libm for it */
            amax = fabsf(block[j]) > amax ? fabsf(block[j]) : amax;
        const float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < BLOCK; j++) {
            const int q = (int)nearbyintf(block[j] * inverse);
            codes[g * BLOCK + j] = (int8_t)q;
            sum += q;
        }
#endif
        scales[g] = d;
        sums[g] = d * (float)sum;
    }
}

/* For tests: the activations exactly as the matmul quantizes them. */
void quantize_rows_int8(const float *x, int64_t rows, int64_t k, int8_t *codes, float *scales,
                        float *sums) {
    for (int64_t t = 0; t < rows; t++)
        quantize_row(x + t * k, k, codes + t * k, scales + t * (k / BLOCK),
                     sums + t * (k / BLOCK));
}

static inline float f16_load(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

#if VNNI
/* sums + the four unsigned codes of each lane of `codes` times the four signed bytes at
   `four`, broadcast from memory by the instruction itself (GCC does not fold the broadcast
   into VNNI's operand: a separate broadcast per product costs a third of the time). */
static inline __m512i dot_broadcast(__m512i sums, __m512i codes, const int8_t *four) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sums) : "v"(codes), "m"(*(const int32_t *)four));
    return sums;
}

/* Byte r·4 + c of the result is byte c·16 + r of a Q4 load (4 code columns of 16 rows):
   each row's 4 columns become one 32-bit lane. */
static const uint8_t Q4_TO_LANES[64] = {
    0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51,
    4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54, 7, 23, 39, 55,
    8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
    12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63,
};

/* One row group (16 output rows) for TOKENS rows of activation codes xq [TOKENS, k] (Q8_0:
   offset to unsigned, q + 128), out[t * n_out + r] for the group's `valid` rows. Called with
   constants, so the loops unroll into registers. */
static inline __attribute__((always_inline)) void row_group(
    const uint8_t *codes, const uint16_t *scales, int64_t k, int quant_type, const int8_t *xq,
    const float *xd, const float *xs, int tokens, float *out, int64_t n_out, int64_t valid) {
    const int64_t groups = k / BLOCK;
    const __m512i to_lanes = _mm512_loadu_si512(Q4_TO_LANES), nibble = _mm512_set1_epi8(15);
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    __m512 acc[MAX_ROWS];
    UNROLL for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i w[8];
        __m512 d, m;
        if (quant_type == Q8_0) {
            const uint8_t *quads = codes + g * BLOCK * LANES;
            UNROLL for (int q = 0; q < 8; q++)
                w[q] = _mm512_xor_si512(_mm512_loadu_si512(quads + q * 4 * LANES), offset);
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * LANES)));
            m = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f)); /* Σ (q + 128)·q_x − 128·Σ q_x */
        } else {
            const uint8_t *column = codes + g * (BLOCK / 2) * LANES;
            UNROLL for (int q = 0; q < 4; q++) {
                const __m512i v = _mm512_permutexvar_epi8(
                    to_lanes, _mm512_loadu_si512(column + q * 4 * LANES));
                w[q] = _mm512_and_si512(v, nibble);                             /* columns 4q.. */
                w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);   /* 16 + 4q.. */
            }
            const uint16_t *s = scales + g * 2 * LANES;
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
            m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + LANES)));
        }
        /* Token-inner: consecutive instructions feed independent sums. */
        __m512i dot[MAX_ROWS];
        UNROLL for (int t = 0; t < tokens; t++) dot[t] = _mm512_setzero_si512();
        UNROLL for (int q = 0; q < 8; q++)
            UNROLL for (int t = 0; t < tokens; t++)
                dot[t] = dot_broadcast(dot[t], w[q], xq + t * k + g * BLOCK + 4 * q);
        UNROLL for (int t = 0; t < tokens; t++) {
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[t * groups + g]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), scale, acc[t]);
            acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t * groups + g]), acc[t]);
        }
    }
    const __mmask16 rows = (__mmask16)((1u << valid) - 1);
    UNROLL for (int t = 0; t < tokens; t++) _mm512_mask_storeu_ps(out + t * n_out, rows, acc[t]);
}
#else
static inline void row_group(const uint8_t *codes, const uint16_t *scales, int64_t k,
                             int quant_type, const int8_t *xq, const float *xd, const float *xs,
                             int tokens, float *out, int64_t n_out, int64_t valid) {
    const int64_t groups = k / BLOCK;
    for (int t = 0; t < tokens; t++) {
        const int8_t *xt = xq + t * k;
        for (int64_t r = 0; r < valid; r++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t dot = 0;
                float d, m = 0.0f;
                if (quant_type == Q8_0) {
                    const int8_t *quads = (const int8_t *)codes + g * BLOCK * LANES;
                    for (int c = 0; c < BLOCK; c++)
                        dot += quads[(c / 4) * 4 * LANES + r * 4 + c % 4] * xt[g * BLOCK + c];
                    d = f16_load(scales[g * LANES + r]);
                } else {
                    const uint8_t *column = codes + g * (BLOCK / 2) * LANES;
                    for (int j = 0; j < BLOCK / 2; j++) {
                        const uint8_t byte = column[j * LANES + r];
                        dot += (byte & 15) * xt[g * BLOCK + j] +
                               (byte >> 4) * xt[g * BLOCK + BLOCK / 2 + j];
                    }
                    d = f16_load(scales[g * 2 * LANES + r]);
                    m = f16_load(scales[g * 2 * LANES + LANES + r]);
                }
                acc += (float)dot * (d * xd[t * groups + g]);
                if (quant_type == Q4) acc += m * xs[t * groups + g];
            }
            out[t * n_out + r] = acc;
        }
    }
}
#endif

typedef void (*group_fn)(const uint8_t *, const uint16_t *, int64_t, const int8_t *,
                         const float *, const float *, float *, int64_t, int64_t);

#define DEFINE_GROUP(NAME, QUANT_TYPE, TOKENS)                                                  \
static void NAME(const uint8_t *codes, const uint16_t *scales, int64_t k, const int8_t *xq,     \
                 const float *xd, const float *xs, float *out, int64_t n_out, int64_t valid) {  \
    row_group(codes, scales, k, QUANT_TYPE, xq, xd, xs, TOKENS, out, n_out, valid);             \
}

#define DEFINE_TYPE(PREFIX, QUANT_TYPE)                                                         \
DEFINE_GROUP(PREFIX##_1, QUANT_TYPE, 1) DEFINE_GROUP(PREFIX##_2, QUANT_TYPE, 2)                 \
DEFINE_GROUP(PREFIX##_3, QUANT_TYPE, 3) DEFINE_GROUP(PREFIX##_4, QUANT_TYPE, 4)                 \
DEFINE_GROUP(PREFIX##_5, QUANT_TYPE, 5) DEFINE_GROUP(PREFIX##_6, QUANT_TYPE, 6)                 \
DEFINE_GROUP(PREFIX##_7, QUANT_TYPE, 7) DEFINE_GROUP(PREFIX##_8, QUANT_TYPE, 8)

DEFINE_TYPE(group_q4, Q4)
DEFINE_TYPE(group_q8_0, Q8_0)

static const group_fn GROUP_BY_TYPE[2][MAX_ROWS] = {
    {group_q4_1, group_q4_2, group_q4_3, group_q4_4, group_q4_5, group_q4_6, group_q4_7,
     group_q4_8},
    {group_q8_0_1, group_q8_0_2, group_q8_0_3, group_q8_0_4, group_q8_0_5, group_q8_0_6,
     group_q8_0_7, group_q8_0_8},
};

/* Bytes of scratch packed_matmul_int8_into needs: the activations' codes and block terms. */
int64_t packed_matmul_int8_scratch(int64_t num_tokens, int64_t k) {
    return num_tokens * k + 2 * (int64_t)sizeof(float) * num_tokens * (k / BLOCK);
}

/* out [num_tokens, n_out] = x [num_tokens, k] · Wᵀ through int8 activations, fp32 in and out,
   contiguous; k a multiple of 32; `scratch` of packed_matmul_int8_scratch bytes, 4-aligned.
   Each thread quantizes some rows, then multiplies whole row groups, their codes staying in
   cache while every pass of 8 token rows reads them. */
void packed_matmul_int8_into(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                             int64_t n_out, int64_t k, const float *x, int64_t num_tokens,
                             float *out, void *scratch, int num_threads) {
    const int64_t groups = k / BLOCK, row_groups = (n_out + LANES - 1) / LANES;
    float *xd = scratch, *xs = xd + num_tokens * groups;
    int8_t *xq = (int8_t *)(xs + num_tokens * groups);
    const group_fn *by_tokens = GROUP_BY_TYPE[quant_type];
    #pragma omp parallel num_threads(num_threads) if(n_out * k * num_tokens >= 65536)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; t++)
            quantize_row(x + t * k, k, xq + t * k, xd + t * groups, xs + t * groups);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < row_groups; n++) {
            const int64_t valid = n_out - n * LANES < LANES ? n_out - n * LANES : LANES;
            const uint8_t *group_codes = codes + n * groups * (quant_type == Q8_0 ? 512 : 256);
            const uint16_t *group_scales = scales + n * groups * (quant_type == Q8_0 ? 16 : 32);
            for (int64_t t = 0; t < num_tokens; t += MAX_ROWS) {
                const int64_t tokens = num_tokens - t < MAX_ROWS ? num_tokens - t : MAX_ROWS;
                by_tokens[tokens - 1](group_codes, group_scales, k, xq + t * k, xd + t * groups,
                                      xs + t * groups, out + t * n_out + n * LANES, n_out, valid);
            }
        }
    }
}

/* The same with its own scratch: -1 where it cannot be allocated, else 0. */
int packed_matmul_int8(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                       int64_t n_out, int64_t k, const float *x, int64_t num_tokens, float *out,
                       int num_threads) {
    void *scratch = malloc(packed_matmul_int8_scratch(num_tokens, k));
    if (scratch == NULL) return -1;
    packed_matmul_int8_into(codes, scales, quant_type, n_out, k, x, num_tokens, out, scratch,
                            num_threads);
    free(scratch);
    return 0;
}
