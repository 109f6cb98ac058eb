/* The packed GGUF matrices (packed_matmul.c's layout) multiplied with int8 activations, for
   steps of many token rows, where the fp32 kernel's cost per row (one FMA per weight and
   token) makes a dense bf16 GEMM win: y = x·Wᵀ.

   Each token row is quantized per 8 columns: d_x = max|x| / 127, q_x = round(x / d_x). (Per
   32, as llama.cpp's Q8 activations are, the embedded model's greedy tokens, teacher-forced
   in 16-token steps, agreed with fp32's at 97.7% of positions; per 8 at 98.6%, as with fp32
   activations: RMSNorm's outlier channels set fewer neighbours' scale.) A weight block's dot
   product is then four integer sums, four code pairs per lane per instruction (AVX-512
   VNNI), scaled per 8 columns and per block:
     Q4 (w = d·q + m, q in 0..15):   d·Σ_s d_xs·Σ q·q_x + m·Σ_s d_xs·Σ q_x
     Q8_0 (w = d·q, q in −127..127): d·Σ_s d_xs·Σ q·q_x
   The integer sums are exact and each row's result depends on its own activations only, so
   a row's output does not depend on the batch around it. The error is the activations'
   rounding (≤ d_x / 2 per element); models/packed.py keeps this path for the step sizes the
   probe (engine/cpu_formats.py) found it fastest at.

   On x86 with AVX-512 VNNI and VBMI (VBMI for the Q4 permute): per 16-row group and 32-column
   block the codes are put into VNNI order once (Q4: one byte permute per 64 bytes, then nibble
   masks; Q8_0 is stored in it) and reused by up to 8 token rows held in registers. With AVX2
   (and on a CPU with VNNI but not VBMI, such as Cascade Lake) the AVX2 path below gives the
   same integer sums in 256-bit vectors. Elsewhere a plain C loop does (tests build all three);
   the probe offers int8 only where a vector path is built. */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "element_types.h"
#include "kernels.h"

#define BLOCK 32
#define SUB 8 /* columns per activation scale */
#define SUBS (BLOCK / SUB)
#define TINY 1e-35f /* columns below this quantize to 0 (127 / amax would overflow) */
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
#if !VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define AVX2_PATH 1
#else
#define AVX2_PATH 0
#endif

/* Whether this build has a vector path (elsewhere the plain C loop is far slower than the
   fp32-activation kernel, and the probe does not offer int8). */
int packed_matmul_int8_vectorized(void) { return VNNI || AVX2_PATH; }

/* x [k] to codes [k], per 8 columns d_x ([k / 8]) and per 32 Σ d_x·q_x ([k / 32]). Rounds to
   nearest even either way (the vector conversion under the default rounding mode,
   nearbyintf). With AVX2 one 8-column group is one vector (the plain loop sums its terms one
   by one and did not vectorize: ~3% of a 32-request decode step on the AVX2 EPYC). */
static void quantize_row(const float *x, int64_t k, int8_t *codes, float *scales, float *sums) {
    for (int64_t g = 0; g < k / BLOCK; g++) {
        const float *block = x + g * BLOCK;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 d[2], q[2];
        for (int half = 0; half < 2; half++) {
            const __m512 v = _mm512_loadu_ps(block + 16 * half);
            __m512 amax = _mm512_abs_ps(v); /* then each lane: its 8 lanes' maximum */
            amax = _mm512_max_ps(amax, _mm512_permute_ps(amax, 0xB1));
            amax = _mm512_max_ps(amax, _mm512_permute_ps(amax, 0x4E));
            amax = _mm512_max_ps(amax, _mm512_shuffle_f32x4(amax, amax, 0xB1));
            const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_set1_ps(TINY), _CMP_GT_OQ);
            const __m512 inverse = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(127.0f), amax);
            d[half] = _mm512_mul_ps(amax, _mm512_set1_ps(1.0f / 127.0f));
            const __m512i codes32 = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));
            _mm_storeu_si128((__m128i *)(codes + g * BLOCK + 16 * half),
                             _mm512_cvtepi32_epi8(codes32));
            q[half] = _mm512_cvtepi32_ps(codes32);
            _mm512_mask_compressstoreu_ps(scales + g * SUBS + 2 * half, 0x0101, d[half]);
        }
        sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_mul_ps(q[0], d[0]),
                                                     _mm512_mul_ps(q[1], d[1])));
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 sum = _mm256_setzero_ps(); /* one 8-column group per vector */
        for (int s = 0; s < SUBS; s++) {
            const __m256 v = _mm256_loadu_ps(block + s * SUB);
            __m256 amax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
            amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0xB1));
            amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0x4E));
            amax = _mm256_max_ps(amax, _mm256_permute2f128_ps(amax, amax, 0x01));
            const float top = _mm256_cvtss_f32(amax);
            const float d = top * (1.0f / 127.0f), inverse = top > TINY ? 127.0f / top : 0.0f;
            const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(v, _mm256_set1_ps(inverse)));
            const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q),
                                                _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i *)(codes + g * BLOCK + s * SUB), _mm_packs_epi16(q16, q16));
            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(d), sum);
            scales[g * SUBS + s] = d;
        }
        const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
        sums[g] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
#else
        float sum = 0.0f;
        for (int s = 0; s < SUBS; s++) {
            const float *sub = block + s * SUB;
            float amax = 0.0f;
            for (int j = 0; j < SUB; j++) /* not fmaxf: GCC calls libm for it */
                amax = fabsf(sub[j]) > amax ? fabsf(sub[j]) : amax;
            const float d = amax * (1.0f / 127.0f), inverse = amax > TINY ? 127.0f / amax : 0.0f;
            for (int j = 0; j < SUB; j++) {
                const int q = (int)nearbyintf(sub[j] * inverse);
                codes[g * BLOCK + s * SUB + j] = (int8_t)q;
                sum += d * (float)q;
            }
            scales[g * SUBS + s] = d;
        }
        sums[g] = sum;
#endif
    }
}

/* For tests: the activations exactly as the matmul quantizes them (scales [rows, k / 8],
   sums [rows, k / 32]). */
void quantize_rows_int8(const float *x, int64_t rows, int64_t k, int8_t *codes, float *scales,
                        float *sums) {
    for (int64_t t = 0; t < rows; t++)
        quantize_row(x + t * k, k, codes + t * k, scales + t * (k / SUB),
                     sums + t * (k / BLOCK));
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

/* One row group (16 output rows) for TOKENS rows of activation codes xq [TOKENS, k] (signed;
   Q8_0 weight codes are offset to unsigned here), out[t * n_out + r] for the group's `valid`
   rows. Called with
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
        /* Per 8 columns (two quads) an integer sum, scaled by its d_x into the block's sum;
           token-inner: consecutive instructions feed independent sums. */
        __m512 block_sum[MAX_ROWS];
        UNROLL for (int s = 0; s < SUBS; s++)
            UNROLL for (int t = 0; t < tokens; t++) {
                const int8_t *xt = xq + t * k + g * BLOCK + s * SUB;
                const __m512i dot = dot_broadcast(
                    dot_broadcast(_mm512_setzero_si512(), w[2 * s], xt), w[2 * s + 1], xt + 4);
                const __m512 x_scale = _mm512_set1_ps(xd[(t * groups + g) * SUBS + s]);
                block_sum[t] = s == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(dot), x_scale)
                                      : _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), x_scale,
                                                        block_sum[t]);
            }
        UNROLL for (int t = 0; t < tokens; t++) {
            acc[t] = _mm512_fmadd_ps(block_sum[t], d, acc[t]);
            acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t * groups + g]), acc[t]);
        }
    }
    const __mmask16 rows = (__mmask16)((1u << valid) - 1);
    UNROLL for (int t = 0; t < tokens; t++) _mm512_mask_storeu_ps(out + t * n_out, rows, acc[t]);
}
#elif AVX2_PATH
/* AVX2 without VNNI: a dot product of 4 code pairs is maddubs (unsigned codes times signed
   activations, adjacent products summed to int16) then madd (adjacent int16 summed to int32).
   Per 4 columns two vectors hold a group's 16 rows, one 32-bit lane per row: Q4 rows 0-3 and
   8-11, then 4-7 and 12-15 (what in-lane byte shuffles of the column-major codes give; the
   sums go back to row order at the end), Q8_0 rows 0-7, then 8-15 (stored that way). Q8_0's
   signed codes go in as magnitudes with their signs moved onto the activations (maddubs's
   first operand is unsigned; offset codes, as VNNI takes them, would overflow its int16). Each
   product of a code and an activation scale d·d_x is formed once per 8 columns, so a row's
   sum is Σ_s (d·d_xs)·Σ q·q_x: the integer sums equal VNNI's, the float steps differ in
   order. */

/* Byte i of each 128-bit lane of the result: the pairs (column c, c + 1) of rows 0-7 from
   a lane holding 8 rows of column c, then the same rows of column c + 1. */
static const uint8_t ROW_PAIRS[32] = {
    0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
    0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
};

/* Two Q4 columns c, c + 1 (16 rows each, contiguous) as pairs: rows 0-7 in the low lane,
   8-15 in the high one. */
static inline __m256i q4_pairs(const uint8_t *columns, __m256i row_pairs) {
    const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)columns), 0xD8);
    return _mm256_shuffle_epi8(v, row_pairs);
}

static inline __m256i dot4(__m256i codes, __m256i x4) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x4), _mm256_set1_epi16(1));
}

/* 8 fp16 scales of rows {a..a+3, b..b+3} as fp32. */
static inline __m256 scales_of(const uint16_t *s, int a, int b) {
    const __m128i four_a = _mm_loadl_epi64((const __m128i *)(s + a));
    const __m128i four_b = _mm_loadl_epi64((const __m128i *)(s + b));
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(four_a, four_b));
}

static inline __attribute__((always_inline)) void row_group(
    const uint8_t *codes, const uint16_t *scales, int64_t k, int quant_type, const int8_t *xq,
    const float *xd, const float *xs, int tokens, float *out, int64_t n_out, int64_t valid) {
    const int64_t groups = k / BLOCK;
    const __m256i row_pairs = _mm256_loadu_si256((const __m256i *)ROW_PAIRS);
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256 acc[MAX_ROWS][2];
    for (int t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i w[8][2]; /* per 4 columns, the two vectors of rows */
        __m256 d[2], m[2];
        if (quant_type == Q8_0) {
            const uint8_t *quads = codes + g * BLOCK * LANES;
            for (int q = 0; q < 8; q++)
                for (int h = 0; h < 2; h++)
                    w[q][h] = _mm256_loadu_si256((const __m256i *)(quads + q * 4 * LANES + 32 * h));
            d[0] = scales_of(scales + g * LANES, 0, 4);
            d[1] = scales_of(scales + g * LANES, 8, 12);
        } else {
            const uint8_t *column = codes + g * (BLOCK / 2) * LANES;
            for (int q = 0; q < 4; q++) {
                const __m256i first = q4_pairs(column + 4 * q * LANES, row_pairs);
                const __m256i second = q4_pairs(column + (4 * q + 2) * LANES, row_pairs);
                const __m256i rows[2] = {_mm256_unpacklo_epi16(first, second),
                                         _mm256_unpackhi_epi16(first, second)};
                for (int h = 0; h < 2; h++) {
                    w[q][h] = _mm256_and_si256(rows[h], nibble);          /* columns 4q.. */
                    w[q + 4][h] = _mm256_and_si256(_mm256_srli_epi16(rows[h], 4), nibble);
                }
            }
            const uint16_t *s = scales + g * 2 * LANES;
            d[0] = scales_of(s, 0, 8);
            d[1] = scales_of(s, 4, 12);
            m[0] = scales_of(s + LANES, 0, 8);
            m[1] = scales_of(s + LANES, 4, 12);
        }
        for (int s = 0; s < SUBS; s++)
            for (int t = 0; t < tokens; t++) {
                const int8_t *xt = xq + t * k + g * BLOCK + s * SUB;
                int32_t four[2];
                memcpy(four, xt, sizeof four);
                const __m256i x4[2] = {_mm256_set1_epi32(four[0]), _mm256_set1_epi32(four[1])};
                const __m256 x_scale = _mm256_set1_ps(xd[(t * groups + g) * SUBS + s]);
                for (int h = 0; h < 2; h++) {
                    __m256i dot;
                    if (quant_type == Q8_0) {
                        const __m256i a = w[2 * s][h], b = w[2 * s + 1][h];
                        dot = _mm256_add_epi32(
                            dot4(_mm256_abs_epi8(a), _mm256_sign_epi8(x4[0], a)),
                            dot4(_mm256_abs_epi8(b), _mm256_sign_epi8(x4[1], b)));
                    } else { /* two quads' int16 sums fit: 4 · 15 · 127 */
                        dot = _mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * s][h], x4[0]),
                                             _mm256_maddubs_epi16(w[2 * s + 1][h], x4[1])),
                            _mm256_set1_epi16(1));
                    }
                    acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                                _mm256_mul_ps(d[h], x_scale), acc[t][h]);
                }
            }
        if (quant_type == Q4)
            for (int t = 0; t < tokens; t++)
                for (int h = 0; h < 2; h++)
                    acc[t][h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(xs[t * groups + g]),
                                                acc[t][h]);
    }
    for (int t = 0; t < tokens; t++) {
        float rows[LANES];
        if (quant_type == Q8_0) {
            _mm256_storeu_ps(rows, acc[t][0]);
            _mm256_storeu_ps(rows + 8, acc[t][1]);
        } else { /* rows {0-3, 8-11} and {4-7, 12-15} back in order */
            _mm256_storeu_ps(rows, _mm256_permute2f128_ps(acc[t][0], acc[t][1], 0x20));
            _mm256_storeu_ps(rows + 8, _mm256_permute2f128_ps(acc[t][0], acc[t][1], 0x31));
        }
        memcpy(out + t * n_out, rows, sizeof(float) * valid);
    }
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
                int32_t dot[SUBS] = {0};
                float d, m = 0.0f;
                if (quant_type == Q8_0) {
                    const int8_t *quads = (const int8_t *)codes + g * BLOCK * LANES;
                    for (int c = 0; c < BLOCK; c++)
                        dot[c / SUB] +=
                            quads[(c / 4) * 4 * LANES + r * 4 + c % 4] * xt[g * BLOCK + c];
                    d = f16_load(scales[g * LANES + r]);
                } else {
                    const uint8_t *column = codes + g * (BLOCK / 2) * LANES;
                    for (int j = 0; j < BLOCK / 2; j++) {
                        const uint8_t byte = column[j * LANES + r];
                        dot[j / SUB] += (byte & 15) * xt[g * BLOCK + j];
                        dot[(BLOCK / 2 + j) / SUB] += (byte >> 4) * xt[g * BLOCK + BLOCK / 2 + j];
                    }
                    d = f16_load(scales[g * 2 * LANES + r]);
                    m = f16_load(scales[g * 2 * LANES + LANES + r]);
                }
                float block_sum = 0.0f;
                for (int s = 0; s < SUBS; s++)
                    block_sum += (float)dot[s] * xd[(t * groups + g) * SUBS + s];
                acc += block_sum * d;
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

DEFINE_1_TO_8(DEFINE_GROUP, group_q4, Q4)
DEFINE_1_TO_8(DEFINE_GROUP, group_q8_0, Q8_0)

static const group_fn GROUP_BY_TYPE[2][MAX_ROWS] = {TABLE_1_TO_8(group_q4),
                                                    TABLE_1_TO_8(group_q8_0)};

/* Bytes of scratch packed_matmul_int8_into needs: the activations' codes and block terms. */
int64_t packed_matmul_int8_scratch(int64_t num_tokens, int64_t k) {
    return num_tokens * k + (int64_t)sizeof(float) * num_tokens * (k / SUB + k / BLOCK);
}

/* out [num_tokens, n_out] = x [num_tokens, k] · Wᵀ through int8 activations, fp32 in and out,
   contiguous; k a multiple of 32; `scratch` of packed_matmul_int8_scratch bytes, 4-aligned.
   Each thread quantizes some rows, then multiplies whole row groups, their codes staying in
   cache while every pass of 8 token rows reads them. */
void packed_matmul_int8_into(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                             int64_t n_out, int64_t k, const float *x, int64_t num_tokens,
                             float *out, void *scratch, int num_threads) {
    const int64_t groups = k / BLOCK, row_groups = (n_out + LANES - 1) / LANES;
    float *xd = scratch, *xs = xd + num_tokens * groups * SUBS;
    int8_t *xq = (int8_t *)(xs + num_tokens * groups);
    const group_fn *by_tokens = GROUP_BY_TYPE[quant_type];
    #pragma omp parallel num_threads(num_threads) if(n_out * k * num_tokens >= 65536)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; t++)
            quantize_row(x + t * k, k, xq + t * k, xd + t * groups * SUBS, xs + t * groups);
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < row_groups; n++) {
            const int64_t valid = n_out - n * LANES < LANES ? n_out - n * LANES : LANES;
            const uint8_t *group_codes = codes + n * groups * (quant_type == Q8_0 ? 512 : 256);
            const uint16_t *group_scales = scales + n * groups * (quant_type == Q8_0 ? 16 : 32);
            for (int64_t t = 0; t < num_tokens; t += MAX_ROWS) {
                const int64_t tokens = num_tokens - t < MAX_ROWS ? num_tokens - t : MAX_ROWS;
                by_tokens[tokens - 1](group_codes, group_scales, k, xq + t * k,
                                      xd + t * groups * SUBS, xs + t * groups,
                                      out + t * n_out + n * LANES, n_out, valid);
            }
        }
    }
}

typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    int64_t quant_type, n_out, k;
    const int8_t *xq;
    const float *xd, *xs;
    float *out;
} one_row;

/* Row group n of one_row's product. */
static void one_row_group(const void *context, int64_t n) {
    const one_row *a = context;
    const int64_t groups = a->k / BLOCK;
    const int64_t valid = a->n_out - n * LANES < LANES ? a->n_out - n * LANES : LANES;
    GROUP_BY_TYPE[a->quant_type][0](
        a->codes + n * groups * (a->quant_type == Q8_0 ? 512 : 256),
        a->scales + n * groups * (a->quant_type == Q8_0 ? 16 : 32), a->k, a->xq, a->xd, a->xs,
        a->out + n * LANES, a->n_out, valid);
}

/* packed_matmul_argmax through int8 activations: packed_matmul_int8's products. */
void packed_matmul_int8_argmax(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                               int64_t n_out, int64_t k, const float *x, float *out,
                               int64_t *token, int num_threads) {
    const int64_t groups = k / BLOCK;
    float xd[groups * SUBS], xs[groups];
    int8_t xq[k];
    quantize_row(x, k, xq, xd, xs);
    const one_row args = {codes, scales, quant_type, n_out, k, xq, xd, xs, out};
    *token = row_groups_argmax(n_out, LANES, out, one_row_group, &args, num_threads);
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
