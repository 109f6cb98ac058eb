/* The packed GGUF matrices (packed_matmul.c's layout) multiplied with int8 activations, for
   steps of many token rows, where the fp32 kernel's cost per row (one FMA per weight and
   token) makes a dense bf16 GEMM win: y = x·Wᵀ.

   Each token row is quantized per 8 columns, with scales that are integer multiples of one
   unit per 32: u = max|x| over the 32 / (127·K), and each 8 columns' scale d_x = k·u with k =
   ⌈K·max|x| over the 8 / max|x| over the 32⌉ (1..K, K = 2048; 0 for an all-zero 8), q_x =
   round(x / d_x) in −127..127. (Per 32 alone, as llama.cpp's Q8 activations are, the embedded
   model's greedy tokens, teacher-forced in 16-token steps, agreed with fp32's at 97.7% of
   positions; per 8 at 98.6%, as with fp32 activations: RMSNorm's outlier channels set fewer
   neighbours' scale. k rounds each 8's scale up by at most 1/k of itself.) A weight block's
   dot product is then an integer sum per 8 columns, weighted by its k (as integers on AVX2 and
   in plain C, which meet the floats once per block; as floats, u·k, with VNNI):
     Q4 (w = d·q + m, q in 0..15):   d·u·Σ_s k_s·Σ q·q_x + m·Σ_s d_xs·Σ q_x
     Q8_0 (w = d·q, q in −127..127): d·u·Σ_s k_s·Σ q·q_x
   The integer sums are exact (at most 4·K·8·128·127 < 2³¹) and each row's result depends on
   its own activations only, so a row's output does not depend on the batch around it. The
   error is the activations' rounding (≤ d_x / 2 per element); models/packed.py keeps this
   path for the step sizes the probe (engine/cpu_formats.py) found it fastest at.

   On x86 with AVX-512 VNNI and VBMI (VBMI for the Q4 permute): per 16-row group and 32-column
   block the codes are put into VNNI order once (Q4: one byte permute per 64 bytes, then nibble
   masks; Q8_0 is stored in it) and reused by up to 8 token rows held in registers. With AVX2
   (and on a CPU with VNNI but not VBMI, such as Cascade Lake) the AVX2 path below gives the
   same 8-column integer sums in 256-bit vectors, and from WIDE_MIN_TOKENS token rows turns
   the vectors around (wide_row_group: 8 tokens per vector, the weights broadcast). Elsewhere
   a plain C loop does (tests build all three); the probe offers int8 only where a vector path
   is built. */

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
#define MAX_MULTIPLE 2048 /* K: an 8-column scale is 1..K units */
#define TINY 1e-30f /* blocks below this quantize to 0 (1 / u would overflow) */
#define LANES 16
#define MAX_ROWS 8 /* token rows per pass over a row group's codes */
#define WIDE_MIN_TOKENS 16 /* token rows from which the AVX2 path turns to wide_row_group */

#if defined(__clang__)
#define UNROLL _Pragma("clang loop unroll(full)")
#else
#define UNROLL _Pragma("GCC unroll 8") /* keeps each token's sums in registers */
#endif

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
#define WIDE AVX2_PATH /* wide_row_group is built */

/* Whether this build has a vector path (elsewhere the plain C loop is far slower than the
   fp32-activation kernel, and the probe does not offer int8). */
int packed_matmul_int8_vectorized(void) { return VNNI || AVX2_PATH; }

#if defined(__AVX2__) && defined(__FMA__)
#define QUANTIZE_VECTOR 1
#define QUANTIZE_BLOCKS 16

/* For 8-column group i: scale[i] = its d, inverse[i] = 1 / d (0 where d is 0), multiples[i] =
   its k, and units[i] = its block's u (see the top), from the groups' largest magnitudes
   `top`: 2 blocks a vector, `count` groups (a multiple of 8, the arrays that long). */
static void block_scales(const float *top, int64_t count, float *scale, float *inverse,
                         int32_t *multiples, float *units) {
    for (int64_t i = 0; i < count; i += 8) {
        const __m256 t = _mm256_loadu_ps(top + i);
        __m256 block_top = _mm256_max_ps(t, _mm256_permute_ps(t, 0xB1));
        block_top = _mm256_max_ps(block_top, _mm256_permute_ps(block_top, 0x4E));
        const __m256 big = _mm256_cmp_ps(block_top, _mm256_set1_ps(TINY), _CMP_GT_OQ);
        const __m256 ratio =
            _mm256_and_ps(big, _mm256_div_ps(_mm256_set1_ps(MAX_MULTIPLE), block_top));
        /* the largest 8's rounds to K or K + 1 */
        const __m256 multiple = _mm256_min_ps(
            _mm256_round_ps(_mm256_mul_ps(t, ratio), _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC),
            _mm256_set1_ps(MAX_MULTIPLE));
        const __m256 unit = _mm256_and_ps(
            big, _mm256_mul_ps(block_top, _mm256_set1_ps(1.0f / (127.0f * MAX_MULTIPLE))));
        const __m256 d = _mm256_mul_ps(unit, multiple);
        const __m256 positive = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_GT_OQ);
        _mm256_storeu_ps(scale + i, d);
        _mm256_storeu_ps(inverse + i,
                         _mm256_and_ps(positive, _mm256_div_ps(_mm256_set1_ps(1.0f), d)));
        _mm256_storeu_si256((__m256i *)(multiples + i), _mm256_cvtps_epi32(multiple));
        _mm256_storeu_ps(units + i, unit);
    }
}
#else
#define QUANTIZE_VECTOR 0

/* u (returned) and each 8 columns' k (see the top) from the 8s' largest magnitudes; u = 0
   and every k 0 for a block whose largest is at most TINY, k = 0 for an all-zero 8. */
static inline float block_unit(const float top[SUBS], int16_t multiples[SUBS]) {
    float block_top = 0.0f;
    for (int s = 0; s < SUBS; s++) block_top = top[s] > block_top ? top[s] : block_top;
    const float ratio = block_top > TINY ? MAX_MULTIPLE / block_top : 0.0f;
    for (int s = 0; s < SUBS; s++) {
        const float multiple = ceilf(top[s] * ratio); /* the largest 8's rounds to K or K + 1 */
        multiples[s] = (int16_t)(multiple < MAX_MULTIPLE ? multiple : MAX_MULTIPLE);
    }
    return block_top > TINY ? block_top * (1.0f / (127.0f * MAX_MULTIPLE)) : 0.0f;
}
#endif

/* x [k] to codes [k], per 32 columns u ([k / 32]) and Σ d_x·q_x ([k / 32]), per 8 k
   ([k / 8]) and, where `scales` is not NULL, d_x = u·k ([k / 8]: what the VNNI path multiplies
   each 8's sum by, read in place of working it out per row group). Rounds to nearest even
   either way (the vector conversion under the default rounding mode, nearbyintf). With AVX2
   one 8-column group is one vector (the plain loop summed its terms one by one and did not
   vectorize: ~3% of a 32-request decode step on the AVX2 EPYC), and the units, multiples and
   reciprocals of QUANTIZE_BLOCKS blocks are worked out together in vectors, between a pass
   that finds each 8's largest magnitude and one that rounds (a block at a time they were a
   chain of scalar divisions: 1-2% of the int8 matmul at 32-64 rows on a Zen 4 EPYC,
   benchmarks/matmul_ab.py). */
static void quantize_row(const float *x, int64_t k, int8_t *codes, float *units,
                         int16_t *multiples, float *sums, float *scales) {
#if QUANTIZE_VECTOR
    enum { EIGHTS = QUANTIZE_BLOCKS * SUBS };
    float top[EIGHTS], scale[EIGHTS], inverse[EIGHTS], unit[EIGHTS];
    int32_t multiple[EIGHTS];
    for (int64_t first = 0; first < k / BLOCK; first += QUANTIZE_BLOCKS) {
        const int64_t blocks =
            k / BLOCK - first < QUANTIZE_BLOCKS ? k / BLOCK - first : QUANTIZE_BLOCKS;
        const int64_t eights = blocks * SUBS, padded = (eights + 7) / 8 * 8;
        const float *chunk = x + first * BLOCK;
        for (int64_t i = 0; i < eights; i++) {
            __m256 amax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(chunk + i * SUB));
            amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0xB1));
            amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0x4E));
            amax = _mm256_max_ps(amax, _mm256_permute2f128_ps(amax, amax, 0x01));
            top[i] = _mm256_cvtss_f32(amax);
        }
        for (int64_t i = eights; i < padded; i++) top[i] = 0.0f;
        block_scales(top, padded, scale, inverse, multiple, unit);
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t g = first + b;
            units[g] = unit[b * SUBS];
            __m256 sum = _mm256_setzero_ps();
            for (int s = 0; s < SUBS; s++) {
                const int64_t i = b * SUBS + s;
                multiples[g * SUBS + s] = (int16_t)multiple[i];
                if (scales) scales[g * SUBS + s] = scale[i];
                const __m256i q = _mm256_cvtps_epi32(
                    _mm256_mul_ps(_mm256_loadu_ps(chunk + i * SUB), _mm256_set1_ps(inverse[i])));
                const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q),
                                                    _mm256_extracti128_si256(q, 1));
                /* Never −128 (a NaN converts to it): the Q8_0 sign trick could not negate it. */
                const __m128i q8 = _mm_max_epi8(_mm_packs_epi16(q16, q16), _mm_set1_epi8(-127));
                _mm_storel_epi64((__m128i *)(codes + g * BLOCK + s * SUB), q8);
                sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(scale[i]), sum);
            }
            const __m128 half =
                _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
            sums[g] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
        }
    }
#else
    for (int64_t g = 0; g < k / BLOCK; g++) {
        const float *block = x + g * BLOCK;
        int16_t *block_multiples = multiples + g * SUBS;
        float top[SUBS];
        for (int s = 0; s < SUBS; s++) {
            top[s] = 0.0f;
            for (int j = 0; j < SUB; j++) /* not fmaxf: GCC calls libm for it */
                top[s] = fabsf(block[s * SUB + j]) > top[s] ? fabsf(block[s * SUB + j]) : top[s];
        }
        const float unit = units[g] = block_unit(top, block_multiples);
        float sum = 0.0f;
        for (int s = 0; s < SUBS; s++) {
            const float d = unit * block_multiples[s], inverse = d > 0.0f ? 1.0f / d : 0.0f;
            if (scales) scales[g * SUBS + s] = d;
            for (int j = 0; j < SUB; j++) {
                const int q = (int)nearbyintf(block[s * SUB + j] * inverse);
                codes[g * BLOCK + s * SUB + j] = (int8_t)q;
                sum += d * (float)q;
            }
        }
        sums[g] = sum;
    }
#endif
}

/* For tests: the activations exactly as the matmul quantizes them (units and sums
   [rows, k / 32], multiples [rows, k / 8]). */
void quantize_rows_int8(const float *x, int64_t rows, int64_t k, int8_t *codes, float *units,
                        int16_t *multiples, float *sums) {
    for (int64_t t = 0; t < rows; t++)
        quantize_row(x + t * k, k, codes + t * k, units + t * (k / BLOCK),
                     multiples + t * (k / SUB), sums + t * (k / BLOCK), NULL);
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
   rows; with `fetch_next`, the next group's weights into the cache meanwhile. Called with
   constants, so the loops unroll into registers. */
static inline __attribute__((always_inline)) void row_group(
    const uint8_t *codes, const uint16_t *scales, int64_t k, int quant_type, const int8_t *xq,
    const float *xu, const int16_t *xk, const float *xs, const float *xd, int tokens, float *out,
    int64_t n_out, int64_t valid, int fetch_next) {
    const int64_t groups = k / BLOCK;
    const __m512i to_lanes = _mm512_loadu_si512(Q4_TO_LANES), nibble = _mm512_set1_epi8(15);
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    __m512 acc[MAX_ROWS];
    UNROLL for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (fetch_next) prefetch_next_row_group(codes, scales, groups, g, quant_type);
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
   first operand is unsigned; offset codes, as VNNI takes them, would overflow its int16). The
   madd that widens each 8 columns' int16 sums to int32 multiplies them by the 8's k instead
   of by 1, so a block's four sums add up as integers and meet the floats once per block (per
   8 columns, the float multiply and FMA had been two of every five instructions on the pipes
   the integer multiplies use): the 8-column integer sums equal VNNI's, the float steps differ
   in order. */

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

/* 8 fp16 scales of rows {a..a+3, b..b+3} as fp32. */
static inline __m256 scales_of(const uint16_t *s, int a, int b) {
    const __m128i four_a = _mm_loadl_epi64((const __m128i *)(s + a));
    const __m128i four_b = _mm_loadl_epi64((const __m128i *)(s + b));
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(four_a, four_b));
}

static inline __attribute__((always_inline)) void row_group(
    const uint8_t *codes, const uint16_t *scales, int64_t k, int quant_type, const int8_t *xq,
    const float *xu, const int16_t *xk, const float *xs, const float *xd, int tokens, float *out,
    int64_t n_out, int64_t valid, int fetch_next) {
    const int64_t groups = k / BLOCK;
    const __m256i row_pairs = _mm256_loadu_si256((const __m256i *)ROW_PAIRS);
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256 acc[MAX_ROWS][2];
    for (int t = 0; t < tokens; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (fetch_next) prefetch_next_row_group(codes, scales, groups, g, quant_type);
        __m256i w[8][2], magnitude[8][2]; /* per 4 columns, the two vectors of rows */
        __m256 d[2], m[2];
        if (quant_type == Q8_0) {
            const uint8_t *quads = codes + g * BLOCK * LANES;
            for (int q = 0; q < 8; q++)
                for (int h = 0; h < 2; h++) {
                    w[q][h] = _mm256_loadu_si256((const __m256i *)(quads + q * 4 * LANES + 32 * h));
                    magnitude[q][h] = _mm256_abs_epi8(w[q][h]);
                }
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
        for (int t = 0; t < tokens; t++) {
            const int8_t *xt = xq + t * k + g * BLOCK;
            const int16_t *token_multiples = xk + (t * groups + g) * SUBS;
            __m256i x4[8], multiple[SUBS];
            for (int q = 0; q < 8; q++) {
                int32_t four;
                memcpy(&four, xt + 4 * q, sizeof four);
                x4[q] = _mm256_set1_epi32(four);
            }
            for (int s = 0; s < SUBS; s++) multiple[s] = _mm256_set1_epi16(token_multiples[s]);
            const __m256 unit = _mm256_set1_ps(xu[t * groups + g]);
            for (int h = 0; h < 2; h++) {
                __m256i dot = _mm256_setzero_si256();
                for (int s = 0; s < SUBS; s++) {
                    const __m256i a = w[2 * s][h], b = w[2 * s + 1][h];
                    if (quant_type == Q8_0) { /* each maddubs's pair sums: ≤ 2 · 128 · 127 */
                        const __m256i first = _mm256_maddubs_epi16(
                            magnitude[2 * s][h], _mm256_sign_epi8(x4[2 * s], a));
                        const __m256i second = _mm256_maddubs_epi16(
                            magnitude[2 * s + 1][h], _mm256_sign_epi8(x4[2 * s + 1], b));
                        dot = _mm256_add_epi32(dot, _mm256_add_epi32(
                                                        _mm256_madd_epi16(first, multiple[s]),
                                                        _mm256_madd_epi16(second, multiple[s])));
                    } else /* two quads' int16 sums fit: 4 · 15 · 127 */
                        dot = _mm256_add_epi32(
                            dot, _mm256_madd_epi16(
                                     _mm256_add_epi16(_mm256_maddubs_epi16(a, x4[2 * s]),
                                                      _mm256_maddubs_epi16(b, x4[2 * s + 1])),
                                     multiple[s]));
                }
                acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[h], unit),
                                            acc[t][h]);
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

/* Steps of WIDE_MIN_TOKENS token rows or more: the roles turn around. A vector holds 8
   tokens, each lane one token's 4 codes of a column quad (the activations are interleaved
   that way once per step), and one row's 4 weight codes are broadcast against it; a Q4 row
   group's codes are unpacked to bytes once per step (Q8_0's are read in place) and read by
   every 8 tokens. Per 8 columns the two quads and k of 8 tokens (k in both int16 halves of a
   lane, so madd weights the lane's two pair sums) serve WIDE_ROWS rows from registers: Q4 per
   two maddubs one madd and about one load, where the path above loads twice per maddubs (its
   broadcasts and its codes, which do not fit the 16 registers); Q8_0 per two maddubs two
   signs, two madds and two broadcasts (the LM head at 32 rows: 1.3-1.6x the path above on
   the AVX2 EPYC). Its integer sums and float steps per block are the path above's, so a
   row's result is the same bit for bit on either. */
#define WIDE_ROWS 8

/* The activations of 8 tokens per vector (lanes past the last token zero). */
typedef struct {
    int8_t *codes;  /* [vectors][k / 4][8][4] */
    int32_t *multiples;  /* [vectors][k / 8][8] */
    float *units, *sums;  /* [vectors][k / 32][8] */
} interleaved;

/* v[i] lane j to v[j] lane i: an 8×8 transpose of 32-bit elements. */
static inline void transpose8x8(__m256i v[8]) {
    __m256i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) {
            b[4 * i + 2 * h] = _mm256_unpacklo_epi64(a[4 * i + h], a[4 * i + 2 + h]);
            b[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(a[4 * i + h], a[4 * i + 2 + h]);
        }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_permute2x128_si256(b[i], b[4 + i], 0x20);
        v[4 + i] = _mm256_permute2x128_si256(b[i], b[4 + i], 0x31);
    }
}

/* Vector `vector`'s 8 tokens of the quantized activations, interleaved: their codes' quads and
   their multiples by 8×8 transposes (k / 4 is a multiple of 8), lanes past the last token
   zero. */
static void interleave(const int8_t *xq, const float *xu, const int16_t *xk, const float *xs,
                       int64_t num_tokens, int64_t k, int64_t vector, const interleaved *x) {
    const int64_t groups = k / BLOCK, subs = k / SUB;
    const int64_t first = vector * 8;
    const int lanes = num_tokens - first < 8 ? (int)(num_tokens - first) : 8;
    int32_t *codes = (int32_t *)(x->codes + first * k);
    int32_t *multiples = x->multiples + first * subs;
    float *units = x->units + first * groups, *sums = x->sums + first * groups;
    for (int64_t q = 0; q < k / 4; q += 8) {
        __m256i v[8];
        for (int lane = 0; lane < 8; lane++)
            v[lane] = lane < lanes ? _mm256_loadu_si256(
                                         (const __m256i *)(xq + (first + lane) * k + 4 * q))
                                   : _mm256_setzero_si256();
        transpose8x8(v);
        for (int j = 0; j < 8; j++) _mm256_storeu_si256((__m256i *)(codes + (q + j) * 8), v[j]);
    }
    int64_t s = 0;
    for (; s + 8 <= subs; s += 8) {
        __m256i v[8];
        for (int lane = 0; lane < 8; lane++) {
            if (lane >= lanes) {
                v[lane] = _mm256_setzero_si256();
                continue;
            }
            const __m256i wide = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)(xk + (first + lane) * subs + s)));
            v[lane] = _mm256_or_si256(wide, _mm256_slli_epi32(wide, 16)); /* k in both halves */
        }
        transpose8x8(v);
        for (int j = 0; j < 8; j++)
            _mm256_storeu_si256((__m256i *)(multiples + (s + j) * 8), v[j]);
    }
    for (; s < subs; s++) /* k / 8 is a multiple of 4: the last 4 one by one */
        for (int lane = 0; lane < 8; lane++) {
            const uint32_t multiple = lane < lanes ? (uint16_t)xk[(first + lane) * subs + s] : 0;
            multiples[s * 8 + lane] = (int32_t)(multiple * 0x10001u);
        }
    for (int lane = 0; lane < 8; lane++)
        for (int64_t g = 0; g < groups; g++) {
            units[g * 8 + lane] = lane < lanes ? xu[(first + lane) * groups + g] : 0.0f;
            sums[g * 8 + lane] = lane < lanes ? xs[(first + lane) * groups + g] : 0.0f;
        }
}

/* Which of the transpose's vectors holds row r (the unpacks reverse the index's bits). */
static const uint8_t TRANSPOSED_ROW[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* A round of the transpose: each pair of vectors interleaved at one width, lows then highs. */
#define TRANSPOSE_ROUND(WIDTH, FROM, TO)                                                        \
    for (int i = 0; i < 8; i++) {                                                               \
        TO[i] = _mm_unpacklo_epi##WIDTH(FROM[2 * i], FROM[2 * i + 1]);                          \
        TO[i + 8] = _mm_unpackhi_epi##WIDTH(FROM[2 * i], FROM[2 * i + 1]);                      \
    }

/* Block g of a Q4 row group (byte r of column j holds row r's codes j and j + 16) as 16 rows
   of 32 unpacked codes, row r at rows + r·k: a 16×16 byte transpose, then the nibbles. */
static inline void unpack_q4_block(const uint8_t *column, uint8_t *rows, int64_t k) {
    __m128i a[16], b[16];
    for (int j = 0; j < 16; j++) a[j] = _mm_loadu_si128((const __m128i *)(column + 16 * j));
    TRANSPOSE_ROUND(8, a, b)
    TRANSPOSE_ROUND(16, b, a)
    TRANSPOSE_ROUND(32, a, b)
    TRANSPOSE_ROUND(64, b, a)
    const __m128i nibble = _mm_set1_epi8(15);
    for (int r = 0; r < 16; r++) {
        const __m128i row = a[TRANSPOSED_ROW[r]];
        _mm_storeu_si128((__m128i *)(rows + r * k), _mm_and_si128(row, nibble));
        _mm_storeu_si128((__m128i *)(rows + r * k + 16),
                         _mm_and_si128(_mm_srli_epi16(row, 4), nibble));
    }
}

/* The sums of WIDE_ROWS rows (from r0) for one interleaved vector of 8 tokens, block by block,
   into tile[row][lane]. Q4: `codes` are the row group's unpacked rows (row r at r·k) and
   each block adds m·Σ d_x·q_x. Q8_0: `codes` are the group's own (row r's quad q of block g
   at g·512 + q·64 + r·4), signed, so each row's four codes take the activations' signs and
   meet their magnitudes (a code of −128 would not negate: the caller keeps such groups on the
   per-token path); a Q8_0 8's two pair sums (each up to 2·127·127) are widened one by one.
   `next`, `next_scales` (NULL: none): the next row group's codes and scales, fetched into
   the cache a block a time meanwhile. */
static inline __attribute__((always_inline)) void wide_tile(
    int quant_type, const uint8_t *codes, int64_t k, const float *d, const float *m,
    const interleaved *x, int64_t v, int64_t r0, const uint8_t *next,
    const uint16_t *next_scales, float tile[WIDE_ROWS][8]) {
    const int64_t groups = k / BLOCK;
    const int64_t block_bytes = block_code_bytes(quant_type);
    const int64_t block_scales = block_scale_count(quant_type);
    const int8_t *xc = x->codes + v * 8 * k;
    const int32_t *xk = x->multiples + v * 8 * (k / SUB);
    const float *xu = x->units + v * 8 * groups, *xs = x->sums + v * 8 * groups;
    for (int64_t g = 0; g < groups; g++) {
        if (next) {
            prefetch_bytes(next + g * block_bytes, block_bytes);
            prefetch_bytes(next_scales + g * block_scales,
                           (int64_t)sizeof(uint16_t) * block_scales);
        }
        __m256i dot[WIDE_ROWS];
        UNROLL for (int r = 0; r < WIDE_ROWS; r++) dot[r] = _mm256_setzero_si256();
        UNROLL for (int s = 0; s < SUBS; s++) {
            const int8_t *quads = xc + (g * 8 + 2 * s) * 32;
            __m256i first = _mm256_loadu_si256((const __m256i *)quads);
            __m256i second = _mm256_loadu_si256((const __m256i *)(quads + 32));
            __m256i multiples = _mm256_loadu_si256((const __m256i *)(xk + (g * SUBS + s) * 8));
            /* Loaded once into registers: GCC would fold each use into its own load. */
            __asm__("" : "+x"(first), "+x"(second), "+x"(multiples));
            if (quant_type == Q4) {
                UNROLL for (int r = 0; r < WIDE_ROWS; r++) {
                    int32_t four[2];
                    memcpy(four, codes + (r0 + r) * k + g * BLOCK + s * SUB, sizeof four);
                    const __m256i pairs = _mm256_add_epi16( /* ≤ 4 · 15 · 127 */
                        _mm256_maddubs_epi16(_mm256_set1_epi32(four[0]), first),
                        _mm256_maddubs_epi16(_mm256_set1_epi32(four[1]), second));
                    dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, multiples));
                    __asm__("" : "+x"(dot[r])); /* a running sum, not an add tree to spill */
                }
            } else {
                __m256i first_magnitude = _mm256_abs_epi8(first);
                __m256i second_magnitude = _mm256_abs_epi8(second);
                __asm__("" : "+x"(first_magnitude), "+x"(second_magnitude));
                UNROLL for (int r = 0; r < WIDE_ROWS; r++) {
                    const uint8_t *row = codes + (g * BLOCK + 2 * s * 4) * LANES + (r0 + r) * 4;
                    int32_t four[2];
                    memcpy(&four[0], row, sizeof four[0]);
                    memcpy(&four[1], row + 4 * LANES, sizeof four[1]);
                    const __m256i a = _mm256_maddubs_epi16(
                        first_magnitude, _mm256_sign_epi8(_mm256_set1_epi32(four[0]), first));
                    const __m256i b = _mm256_maddubs_epi16(
                        second_magnitude, _mm256_sign_epi8(_mm256_set1_epi32(four[1]), second));
                    const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(a, multiples),
                                                          _mm256_madd_epi16(b, multiples));
                    dot[r] = _mm256_add_epi32(dot[r], sums);
                    __asm__("" : "+x"(dot[r]));
                }
            }
        }
        const __m256 unit = _mm256_loadu_ps(xu + g * 8);
        UNROLL for (int r = 0; r < WIDE_ROWS; r++) {
            __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]),
                                         _mm256_mul_ps(_mm256_set1_ps(d[g * LANES + r0 + r]), unit),
                                         _mm256_loadu_ps(tile[r]));
            if (quant_type == Q4)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(m[g * LANES + r0 + r]),
                                      _mm256_loadu_ps(xs + g * 8), acc);
            _mm256_storeu_ps(tile[r], acc);
        }
    }
}

/* Whether a Q8_0 row group's codes hold a −128 (which wide_tile cannot negate). */
static int holds_minimum(const uint8_t *codes, int64_t groups) {
    __m256i found = _mm256_setzero_si256();
    for (int64_t i = 0; i < groups * BLOCK * LANES; i += 32)
        found = _mm256_or_si256(found, _mm256_cmpeq_epi8(
                                           _mm256_loadu_si256((const __m256i *)(codes + i)),
                                           _mm256_set1_epi8((char)0x80)));
    return !_mm256_testz_si256(found, found);
}

/* One row group for all tokens (x: their `vectors` interleaved vectors), out[t·n_out + r] for
   its `valid` rows: Q4's codes unpacked once, then tiles of WIDE_ROWS rows by 8 tokens (the
   tile in memory: the registers hold the integer sums). With `last` 0, the next row group's
   codes and scales (contiguous after this one's) are fetched during the first tile: its first
   pass over them (Q4's unpacking, Q8_0's check for −128) would wait for memory otherwise,
   with nothing else to do. */
static void wide_row_group(const uint8_t *codes, const uint16_t *scales, int64_t k,
                           int quant_type, const interleaved *x, int64_t num_tokens, float *out,
                           int64_t n_out, int64_t valid, int last) {
    const int64_t groups = k / BLOCK, vectors = (num_tokens + 7) / 8;
    const uint8_t *next = last ? NULL : codes + groups * block_code_bytes(quant_type);
    const uint16_t *next_scales = scales + groups * block_scale_count(quant_type);
    uint8_t rows[quant_type == Q4 ? LANES * k : 1];
    float d[groups * LANES], m[groups * LANES];
    for (int64_t g = 0; g < groups; g++) {
        if (quant_type == Q4)
            unpack_q4_block(codes + g * (BLOCK / 2) * LANES, rows + g * BLOCK, k);
        const uint16_t *s = scales + g * block_scale_count(quant_type);
        for (int h = 0; h < 2; h++) {
            _mm256_storeu_ps(d + g * LANES + 8 * h,
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 8 * h))));
            if (quant_type == Q4)
                _mm256_storeu_ps(m + g * LANES + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(
                                                            (const __m128i *)(s + LANES + 8 * h))));
        }
    }
    for (int64_t r0 = 0; r0 < valid; r0 += WIDE_ROWS)
        for (int64_t v = 0; v < vectors; v++) {
            float tile[WIDE_ROWS][8] = {{0.0f}};
            const uint8_t *fetch = r0 == 0 && v == 0 ? next : NULL;
            if (quant_type == Q4)
                wide_tile(Q4, rows, k, d, m, x, v, r0, fetch, next_scales, tile);
            else
                wide_tile(Q8_0, codes, k, d, m, x, v, r0, fetch, next_scales, tile);
            const int64_t lanes = num_tokens - v * 8 < 8 ? num_tokens - v * 8 : 8;
            const int64_t tile_rows = valid - r0 < WIDE_ROWS ? valid - r0 : WIDE_ROWS;
            for (int64_t lane = 0; lane < lanes; lane++)
                for (int64_t r = 0; r < tile_rows; r++)
                    out[(v * 8 + lane) * n_out + r0 + r] = tile[r][lane];
        }
}
#else
static inline void row_group(const uint8_t *codes, const uint16_t *scales, int64_t k,
                             int quant_type, const int8_t *xq, const float *xu, const int16_t *xk,
                             const float *xs, const float *xd, int tokens, float *out,
                             int64_t n_out, int64_t valid, int fetch_next) {
    const int64_t groups = k / BLOCK;
    for (int t = 0; t < tokens; t++) {
        const int8_t *xt = xq + t * k;
        for (int64_t r = 0; r < valid; r++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                if (fetch_next && t == 0 && r == 0)
                    prefetch_next_row_group(codes, scales, groups, g, quant_type);
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
                int32_t block_sum = 0;
                for (int s = 0; s < SUBS; s++)
                    block_sum += dot[s] * xk[(t * groups + g) * SUBS + s];
                acc += (float)block_sum * (d * xu[t * groups + g]);
                if (quant_type == Q4) acc += m * xs[t * groups + g];
            }
            out[t * n_out + r] = acc;
        }
    }
}
#endif

typedef void (*group_fn)(const uint8_t *, const uint16_t *, int64_t, const int8_t *,
                         const float *, const int16_t *, const float *, const float *, float *,
                         int64_t, int64_t, int);

#define DEFINE_GROUP(NAME, QUANT_TYPE, TOKENS)                                                  \
static void NAME(const uint8_t *codes, const uint16_t *scales, int64_t k, const int8_t *xq,     \
                 const float *xu, const int16_t *xk, const float *xs, const float *xd,          \
                 float *out, int64_t n_out, int64_t valid, int fetch_next) {                    \
    row_group(codes, scales, k, QUANT_TYPE, xq, xu, xk, xs, xd, TOKENS, out, n_out, valid,      \
              fetch_next);                                                                      \
}

DEFINE_1_TO_8(DEFINE_GROUP, group_q4, Q4)
DEFINE_1_TO_8(DEFINE_GROUP, group_q8_0, Q8_0)

static const group_fn GROUP_BY_TYPE[2][MAX_ROWS] = {TABLE_1_TO_8(group_q4),
                                                    TABLE_1_TO_8(group_q8_0)};

int packed_matmul_int8_wide(int64_t num_tokens) { return WIDE && num_tokens >= WIDE_MIN_TOKENS; }

/* Bytes of scratch packed_matmul_int8_into needs: the activations' codes and block terms
   (with VNNI their per-8 scales too), then (for wide_row_group) the same interleaved per 8
   tokens. */
int64_t packed_matmul_int8_scratch(int64_t num_tokens, int64_t k) {
    const int64_t padded = (num_tokens + 7) / 8 * 8;
    return num_tokens * k + (int64_t)sizeof(int16_t) * num_tokens * (k / SUB) +
           (int64_t)sizeof(float) * num_tokens * 2 * (k / BLOCK) +
           (VNNI ? (int64_t)sizeof(float) * num_tokens * (k / SUB) : 0) +
           (WIDE ? padded * k + (int64_t)sizeof(int32_t) * padded * (k / SUB) +
                       (int64_t)sizeof(float) * padded * 2 * (k / BLOCK)
                 : 0);
}

/* out [num_tokens, n_out] = x [num_tokens, k] · Wᵀ through int8 activations, fp32 in and out,
   contiguous; k a multiple of 32; `scratch` of packed_matmul_int8_scratch bytes, 4-aligned.
   Each thread quantizes some rows (for wide_row_group then interleaves some vectors of 8),
   then multiplies whole row groups, their codes staying in cache while every pass of 8 token
   rows reads them. */
void packed_matmul_int8_into(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                             int64_t n_out, int64_t k, const float *x, int64_t num_tokens,
                             float *out, void *scratch, int num_threads) {
    const int64_t groups = k / BLOCK, row_groups = (n_out + LANES - 1) / LANES;
    float *xu = scratch, *xs = xu + num_tokens * groups;
    float *xd = VNNI ? xs + num_tokens * groups : NULL; /* per 8: u·k */
    int16_t *xk = (int16_t *)(xs + num_tokens * groups * (VNNI ? 1 + SUBS : 1));
    int8_t *xq = (int8_t *)(xk + num_tokens * groups * SUBS);
    const group_fn *by_tokens = GROUP_BY_TYPE[quant_type];
#if WIDE
    const int wide = packed_matmul_int8_wide(num_tokens);
    const int64_t vectors = (num_tokens + 7) / 8;
    int8_t *interleaved_codes = xq + num_tokens * k;
    int32_t *interleaved_multiples = (int32_t *)(interleaved_codes + vectors * 8 * k);
    float *interleaved_units = (float *)(interleaved_multiples + vectors * 8 * (k / SUB));
    const interleaved by_vector = {interleaved_codes, interleaved_multiples, interleaved_units,
                                   interleaved_units + vectors * 8 * groups};
#endif
    #pragma omp parallel num_threads(num_threads) if(n_out * k * num_tokens >= 65536)
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; t++)
            quantize_row(x + t * k, k, xq + t * k, xu + t * groups, xk + t * groups * SUBS,
                         xs + t * groups, xd ? xd + t * groups * SUBS : NULL);
#if WIDE
        if (wide) {
            #pragma omp for schedule(static)
            for (int64_t v = 0; v < vectors; v++)
                interleave(xq, xu, xk, xs, num_tokens, k, v, &by_vector);
        }
#endif
        /* Guided: contiguous shares, halving as the threads finish, so a core slowed by
           whatever else the machine runs does not keep the other waiting at the barrier (with
           equal static shares that wait was ~5% of a 32-request decode step on the 2-core
           EPYC; one share per group, dynamic, lost the streaming of consecutive groups). */
        #pragma omp for schedule(guided)
        for (int64_t n = 0; n < row_groups; n++) {
            const int64_t valid = n_out - n * LANES < LANES ? n_out - n * LANES : LANES;
            const uint8_t *group_codes = codes + n * groups * block_code_bytes(quant_type);
            const uint16_t *group_scales = scales + n * groups * block_scale_count(quant_type);
#if WIDE
            if (wide && (quant_type == Q4 || !holds_minimum(group_codes, groups))) {
                wide_row_group(group_codes, group_scales, k, quant_type, &by_vector, num_tokens,
                               out + n * LANES, n_out, valid, n + 1 == row_groups);
                continue;
            }
#endif
            for (int64_t t = 0; t < num_tokens; t += MAX_ROWS) {
                const int64_t tokens = num_tokens - t < MAX_ROWS ? num_tokens - t : MAX_ROWS;
                by_tokens[tokens - 1](group_codes, group_scales, k, xq + t * k, xu + t * groups,
                                      xk + t * groups * SUBS, xs + t * groups,
                                      xd ? xd + t * groups * SUBS : NULL,
                                      out + t * n_out + n * LANES, n_out, valid,
                                      t == 0 && n + 1 < row_groups);
            }
        }
    }
}

typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    int64_t quant_type, n_out, k;
    const int8_t *xq;
    const float *xu;
    const int16_t *xk;
    const float *xs, *xd;
    float *out;
} one_row;

/* Row group n of one_row's product. */
static void one_row_group(const void *context, int64_t n) {
    const one_row *a = context;
    const int64_t groups = a->k / BLOCK;
    const int64_t valid = a->n_out - n * LANES < LANES ? a->n_out - n * LANES : LANES;
    GROUP_BY_TYPE[a->quant_type][0](
        a->codes + n * groups * block_code_bytes(a->quant_type),
        a->scales + n * groups * block_scale_count(a->quant_type), a->k, a->xq, a->xu, a->xk,
        a->xs, a->xd, a->out + n * LANES, a->n_out, valid, (n + 1) * LANES < a->n_out);
}

/* packed_matmul_argmax through int8 activations: packed_matmul_int8's products. */
void packed_matmul_int8_argmax(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                               int64_t n_out, int64_t k, const float *x, float *out,
                               int64_t *token, int num_threads) {
    const int64_t groups = k / BLOCK;
    float xu[groups], xs[groups], xd[groups * SUBS];
    int16_t xk[groups * SUBS];
    int8_t xq[k];
    quantize_row(x, k, xq, xu, xk, xs, VNNI ? xd : NULL);
    const one_row args = {codes, scales, quant_type, n_out, k, xq, xu, xk, xs, xd, out};
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
