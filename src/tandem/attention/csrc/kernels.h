/* The kernels one C file calls from another (the fused decode forward calls the rest). */

#ifndef TANDEM_KERNELS_H
#define TANDEM_KERNELS_H

#include <stdint.h>

#define DECLARE_DECODE(NAME, T)                                                                \
    void NAME(const T *query, int64_t q_token_stride, int64_t q_head_stride, const T *kv_cache, \
              int64_t num_blocks, const int64_t *block_table, int64_t bt_stride,                \
              const int64_t *token_rows, const int64_t *token_requests,                         \
              const int64_t *token_seq_lens, int64_t num_tokens, int64_t num_heads,             \
              int64_t num_kv_heads, int64_t head_dim_arg, int64_t block_size, float scale,      \
              T *out, int num_threads);

DECLARE_DECODE(paged_decode_attention_f32, float)
DECLARE_DECODE(paged_decode_attention_f32_64, float)
DECLARE_DECODE(paged_decode_attention_f32_128, float)
DECLARE_DECODE(paged_decode_attention_bf16, uint16_t)
DECLARE_DECODE(paged_decode_attention_bf16_64, uint16_t)
DECLARE_DECODE(paged_decode_attention_bf16_128, uint16_t)

void rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t size,
                  float eps, int num_threads);
void rotary_f32(float *x, int64_t token_stride, int64_t num_heads, int64_t head_dim,
                const float *cos_sin, int64_t table_stride, int64_t num_tokens, int num_threads);
void packed_matmul(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                   int64_t n_out, int64_t k, const float *x, int64_t num_tokens, float *out,
                   int num_threads);
void packed_matmul_argmax(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                          int64_t n_out, int64_t k, const float *x, float *out, int64_t *token,
                          int num_threads);
void packed_matmul_int8_argmax(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                               int64_t n_out, int64_t k, const float *x, float *out,
                               int64_t *token, int num_threads);
/* out [n_out] computed a group of group_rows at a time over the threads (compute(context, n)
   writes group n), and the first index of its largest value (NaN skipped; 0 where every value
   is NaN), as argmax_rows finds it: each thread scans the columns it has just written, while
   they are in its cache, and the threads' answers merge in column order. */
int64_t row_groups_argmax(int64_t n_out, int64_t group_rows, float *out,
                          void (*compute)(const void *context, int64_t group),
                          const void *context, int num_threads);

/* Asks the cache for `bytes` from `start` ahead of their use (a prefetch never faults). The
   matmuls fetch the next rows' weights while they multiply this one's, so that the weights'
   stream from memory overlaps the arithmetic instead of alternating with it: on the 2-core
   Zen 5 EPYC, over the embedded model's 30 layers (benchmarks/matmul_ab.py), the packed int8
   product of 6-16 token rows took 1.3-1.5x less time (1.1-1.4x at 1-4 rows, 1.3x at 32), the
   dense fp32 one of 4-32 rows 1.25-1.35x less. */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch((const char *)start + byte);
}

/* The packed matmuls' layout (models/packed.py): row groups of 16 output rows one after
   another, each a run of 32-column blocks of one quant type's codes and fp16 scales. */
enum { Q4 = 0, Q8_0 = 1 }; /* Q4: w = d·q + m (a Q4_0 block arrives with m = −8d) */
static inline int64_t block_code_bytes(int64_t quant_type) {
    return quant_type == Q8_0 ? 512 : 256;
}
static inline int64_t block_scale_count(int64_t quant_type) { /* Q4: d, then m */
    return quant_type == Q8_0 ? 16 : 32;
}

/* Block g of the row group after the one at `codes`, `scales` (`groups` blocks each) into the
   cache: a matmul fetches it while it multiplies this group's block g. */
static inline void prefetch_next_row_group(const uint8_t *codes, const uint16_t *scales,
                                           int64_t groups, int64_t g, int64_t quant_type) {
    prefetch_bytes(codes + (groups + g) * block_code_bytes(quant_type),
                   block_code_bytes(quant_type));
    prefetch_bytes(scales + (groups + g) * block_scale_count(quant_type),
                   (int64_t)sizeof(uint16_t) * block_scale_count(quant_type));
}

/* The packed matmuls' functions specialized per token-row count, 1 to 8 (their loops unroll
   into registers): DEFINE(PREFIX_n, QUANT_TYPE, n) for each n, and a table of them. */
#define DEFINE_1_TO_8(DEFINE, PREFIX, QUANT_TYPE)                                               \
    DEFINE(PREFIX##_1, QUANT_TYPE, 1) DEFINE(PREFIX##_2, QUANT_TYPE, 2)                         \
    DEFINE(PREFIX##_3, QUANT_TYPE, 3) DEFINE(PREFIX##_4, QUANT_TYPE, 4)                         \
    DEFINE(PREFIX##_5, QUANT_TYPE, 5) DEFINE(PREFIX##_6, QUANT_TYPE, 6)                         \
    DEFINE(PREFIX##_7, QUANT_TYPE, 7) DEFINE(PREFIX##_8, QUANT_TYPE, 8)
#define TABLE_1_TO_8(PREFIX)                                                                    \
    {PREFIX##_1, PREFIX##_2, PREFIX##_3, PREFIX##_4, PREFIX##_5, PREFIX##_6, PREFIX##_7,       \
     PREFIX##_8}

/* One token per row of fp32 logits [rows, vocab] (sample_rows.c): the argmax where the
   temperature is 0, else a draw at u[r] after min-p, top-k (0: none) and top-p; scratch: 2 *
   vocab candidates of 8 bytes per thread. */
void sample_rows(const float *logits, int64_t rows, int64_t vocab, const float *temperature,
                 const int64_t *top_k, const float *top_p, const float *min_p, const float *u,
                 int64_t *tokens, void *scratch, int num_threads);

/* Structured outputs: -inf in each listed row of logits [*, vocab] for the tokens whose bit is
   clear in its row of bitmask [num_rows, words] (xgrammar's int32 layout). */
void mask_rows(float *logits, int64_t vocab, const int64_t *rows, int64_t num_rows,
               const int32_t *bitmask, int64_t words);

/* tokens[r] = the first argmax of each row of logits [rows, vocab], as torch's. */
void argmax_rows(const float *logits, int64_t rows, int64_t vocab, int64_t *tokens,
                 int num_threads);

int64_t packed_matmul_int8_scratch(int64_t num_tokens, int64_t k);
/* Whether a product of this many token rows takes the wide kernel (AVX2 builds), whose
   unpacked weights serve all the rows of the call. */
int packed_matmul_int8_wide(int64_t num_tokens);
void packed_matmul_int8_into(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                             int64_t n_out, int64_t k, const float *x, int64_t num_tokens,
                             float *out, void *scratch, int num_threads);
int packed_matmul_int8(const uint8_t *codes, const uint16_t *scales, int64_t quant_type,
                       int64_t n_out, int64_t k, const float *x, int64_t num_tokens, float *out,
                       int num_threads);

#endif
