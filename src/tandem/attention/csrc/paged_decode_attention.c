/* Decode attention over the paged KV cache, read in place (no gathered copy of each context).

   One work item is (decode token, kv head): the token's query heads of that kv head (a GQA
   group) attend together to its context, block by block through its request's block table,
   with an online softmax in fp32. Items are spread over OpenMP threads; the library links the
   libgomp torch already loaded, so it shares torch's thread pool. Built by cpu_kernel.py for
   the machine it runs on, with reassociation allowed (vectorized reductions) but not
   -ffast-math, whose start-up code would set flush-to-zero for the whole process. */

#include <string.h>

#include "element_types.h"
#include "vector_math.h"

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

/* DEFINE_DECODE(name, element type, load, store): one kernel per cache dtype.
   query [tokens, heads, head_dim] with strides (q_token_stride, q_head_stride, 1);
   kv_cache [2, num_blocks, block_size, kv_heads, head_dim] contiguous;
   block_table [requests, bt_stride] int64; per decode token: its row of query/out, its
   request, its context length; out [tokens, heads, head_dim] contiguous. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, HEAD_DIM)                                                     \
void NAME(const T *query, int64_t q_token_stride, int64_t q_head_stride,                        \
          const T *kv_cache, int64_t num_blocks, const int64_t *block_table,                    \
          int64_t bt_stride, const int64_t *token_rows, const int64_t *token_requests,          \
          const int64_t *token_seq_lens, int64_t num_tokens, int64_t num_heads,                 \
          int64_t num_kv_heads, int64_t head_dim_arg, int64_t block_size, float scale, T *out,  \
          int num_threads) {                                                                    \
    const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_arg;                            \
    const int64_t group = num_heads / num_kv_heads;                                             \
    const int64_t row = num_kv_heads * head_dim; /* one position's keys, all kv heads */        \
    const T *value_cache = kv_cache + num_blocks * block_size * row;                            \
    _Pragma("omp parallel for collapse(2) schedule(static) num_threads(num_threads)")           \
    for (int64_t t = 0; t < num_tokens; t++) {                                                  \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                            \
            float q[MAX_GROUP][MAX_HEAD_DIM];                                                   \
            float acc[MAX_GROUP][MAX_HEAD_DIM];                                                 \
            float scores[MAX_GROUP][MAX_BLOCK];                                                 \
            float running_max[MAX_GROUP], running_sum[MAX_GROUP];                               \
            const int64_t token = token_rows[t];                                                \
            const int64_t context = token_seq_lens[t];                                          \
            const int64_t *blocks = block_table + token_requests[t] * bt_stride;                \
            for (int64_t g = 0; g < group; g++) {                                               \
                const T *src = query + token * q_token_stride + (h * group + g) * q_head_stride; \
                for (int64_t d = 0; d < head_dim; d++) q[g][d] = LOAD(src[d]) * scale;          \
                memset(acc[g], 0, sizeof(float) * head_dim);                                    \
                running_max[g] = -INFINITY;                                                     \
                running_sum[g] = 0.0f;                                                          \
            }                                                                                   \
            for (int64_t start = 0; start < context; start += block_size) {                     \
                const int64_t block = blocks[start / block_size];                               \
                const int64_t count = context - start < block_size ? context - start : block_size; \
                const T *keys = kv_cache + block * block_size * row + h * head_dim;             \
                const T *values = value_cache + block * block_size * row + h * head_dim;        \
                if (start + block_size < context) { /* the next block is elsewhere: fetch it */ \
                    const int64_t next = blocks[start / block_size + 1] * block_size * row;     \
                    for (int64_t p = 0; p < block_size; p++)                                    \
                        for (int64_t byte = 0; byte < head_dim * (int64_t)sizeof(T); byte += 64) { \
                            __builtin_prefetch((const char *)(kv_cache + next + p * row + h * head_dim) + byte); \
                            __builtin_prefetch((const char *)(value_cache + next + p * row + h * head_dim) + byte); \
                        }                                                                       \
                }                                                                               \
                for (int64_t p = 0; p < count; p++) {                                           \
                    const T *key = keys + p * row;                                              \
                    float k[MAX_HEAD_DIM];                                                      \
                    for (int64_t d = 0; d < head_dim; d++) k[d] = LOAD(key[d]);                 \
                    for (int64_t g = 0; g < group; g++) {                                       \
                        float dot = 0.0f;                                                       \
                        _Pragma("omp simd reduction(+:dot)")                                    \
                        for (int64_t d = 0; d < head_dim; d++) dot += q[g][d] * k[d];           \
                        scores[g][p] = dot;                                                     \
                    }                                                                           \
                }                                                                               \
                for (int64_t g = 0; g < group; g++) {                                           \
                    float block_max = running_max[g];                                           \
                    for (int64_t p = 0; p < count; p++)                                         \
                        block_max = scores[g][p] > block_max ? scores[g][p] : block_max;        \
                    const float rescale = exp_nonpositive(running_max[g] - block_max);                     \
                    running_sum[g] *= rescale;                                                  \
                    for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= rescale;                \
                    float block_sum = 0.0f;                                                     \
                    _Pragma("omp simd reduction(+:block_sum)")                                  \
                    for (int64_t p = 0; p < count; p++) {                                       \
                        scores[g][p] = exp_nonpositive(scores[g][p] - block_max);               \
                        block_sum += scores[g][p];                                              \
                    }                                                                           \
                    running_sum[g] += block_sum;                                                \
                    running_max[g] = block_max;                                                 \
                }                                                                               \
                for (int64_t p = 0; p < count; p++) {                                           \
                    const T *value = values + p * row;                                          \
                    float v[MAX_HEAD_DIM];                                                      \
                    for (int64_t d = 0; d < head_dim; d++) v[d] = LOAD(value[d]);               \
                    for (int64_t g = 0; g < group; g++) {                                       \
                        const float weight = scores[g][p];                                      \
                        _Pragma("omp simd")                                                     \
                        for (int64_t d = 0; d < head_dim; d++) acc[g][d] += weight * v[d];      \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (int64_t g = 0; g < group; g++) {                                               \
                T *dst = out + (token * num_heads + h * group + g) * head_dim;                  \
                const float inverse = 1.0f / running_sum[g];                                    \
                for (int64_t d = 0; d < head_dim; d++) dst[d] = STORE(acc[g][d] * inverse);     \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}

/* Any head size, and the common ones as constants (fully unrolled dot products). */
DEFINE_DECODE(paged_decode_attention_f32, float, f32_load, f32_store, 0)
DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, bf16_load, bf16_store, 0)
DEFINE_DECODE(paged_decode_attention_f32_64, float, f32_load, f32_store, 64)
DEFINE_DECODE(paged_decode_attention_bf16_64, uint16_t, bf16_load, bf16_store, 64)
DEFINE_DECODE(paged_decode_attention_f32_128, float, f32_load, f32_store, 128)
DEFINE_DECODE(paged_decode_attention_bf16_128, uint16_t, bf16_load, bf16_store, 128)
