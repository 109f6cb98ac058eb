/* Decode attention over the paged KV cache, read in place (no gathered copy of each context).

   One work item is (decode token, kv head): the token's query heads of that kv head (a GQA
   group) attend together to its context, block by block through its request's block table,
   with an online softmax in fp32. Items are spread over OpenMP threads; the library links the
   libgomp torch already loaded, so it shares torch's thread pool. Built by cpu_kernel.py for
   the machine it runs on, with reassociation allowed (vectorized reductions) but not
   -ffast-math, whose start-up code would set flush-to-zero for the whole process. */

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "element_types.h"
#include "vector_math.h"

#define MAX_GROUP 32
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

#if defined(__AVX512F__)
#include <immintrin.h>

/* The head sizes compiled as constants take a vector path on AVX-512: keys in chunks of 16,
   each query head's 16 dot products left as 16 vectors of partial sums and folded into one
   vector of 16 scores at once (46 shuffles and adds, where 16 separate horizontal sums were
   the kernel's bottleneck), the softmax over the chunk's 16 lanes, and each head's output
   accumulated in registers. */
#define CHUNK 16

/* sums[p] = Σ lanes of v[p], p < 16: pairs of vectors folded a half, a quarter, ... at a time;
   the last step leaves the sum of v[4j + k] in lane 4k + j, hence the final permute. */
static inline __m512 lane_sums16(const __m512 v[CHUNK]) {
    __m512 halves[8], quarters[4], pairs[2];
    for (int i = 0; i < 8; i++)
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                      _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, sums);
}

/* exp_nonpositive (vector_math.h) over 16 lanes: the same polynomial. */
static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 y = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(EXP2_POLYNOMIAL[0]);
    for (int i = 1; i < EXP2_DEGREE + 1; i++)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLYNOMIAL[i]));
    const __m512i exponent = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* One work item (a token's `group` query heads of one kv head) on the vector path, over the
   positions [begin, context) of its context; `state` NULL: the normalized output to `out`,
   else each head's unnormalized sums, running max and sum (head_dim + 2 floats) to `state`,
   for split_items to merge. */
#define DEFINE_ITEM(NAME, T, LOAD16, STORE, D)                                                  \
static void NAME(const T *query, int64_t q_head_stride, const T *kv_cache,                      \
                 const T *value_cache, int64_t row, const int64_t *blocks, int64_t begin,       \
                 int64_t context, int64_t block_size, int64_t group, float scale, T *out,       \
                 float *state) {                                                                \
    enum { V = D / 16 };                                                                        \
    float keys[CHUNK][D] __attribute__((aligned(64)));                                          \
    float values[CHUNK][D] __attribute__((aligned(64)));                                        \
    float acc[MAX_GROUP][D] __attribute__((aligned(64)));                                       \
    float weights[CHUNK] __attribute__((aligned(64)));                                          \
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];                                       \
    for (int64_t g = 0; g < group; g++) {                                                       \
        memset(acc[g], 0, sizeof acc[g]);                                                       \
        running_max[g] = -INFINITY;                                                             \
        running_sum[g] = 0.0f;                                                                  \
    }                                                                                           \
    int64_t count; /* keys in this chunk: up to 16, within one block */                        \
    for (int64_t start = begin; start < context; start += count) {                              \
        const int64_t in_block = start % block_size;                                            \
        const int64_t block = blocks[start / block_size];                                       \
        count = context - start < CHUNK ? context - start : CHUNK;                              \
        if (count > block_size - in_block) count = block_size - in_block;                       \
        const int64_t first = (block * block_size + in_block) * row;                            \
        /* The next chunk's rows are fetched while this one's are converted, a row each. */  \
        const int64_t next = start + count;                                                     \
        int64_t ahead = next < context ? context - next : 0;                                    \
        if (ahead > CHUNK) ahead = CHUNK;                                                       \
        if (ahead > block_size - next % block_size) ahead = block_size - next % block_size;     \
        const int64_t from =                                                                    \
            ahead ? (blocks[next / block_size] * block_size + next % block_size) * row : 0;     \
        for (int64_t p = 0; p < count || p < ahead; p++) {                                      \
            if (p < ahead)                                                                      \
                for (int64_t byte = 0; byte < D * (int64_t)sizeof(T); byte += 64) {             \
                    __builtin_prefetch((const char *)(kv_cache + from + p * row) + byte);       \
                    __builtin_prefetch((const char *)(value_cache + from + p * row) + byte);    \
                }                                                                               \
            if (p < count)                                                                      \
                for (int c = 0; c < V; c++) {                                                   \
                    _mm512_store_ps(keys[p] + 16 * c,                                           \
                                    LOAD16(kv_cache + first + p * row + 16 * c));               \
                    _mm512_store_ps(values[p] + 16 * c,                                         \
                                    LOAD16(value_cache + first + p * row + 16 * c));            \
                }                                                                               \
        }                                                                                       \
        const __mmask16 valid = (__mmask16)((1u << count) - 1);                                 \
        for (int64_t g = 0; g < group; g++) {                                                   \
            const T *q_row = query + g * q_head_stride;                                         \
            __m512 q[V], partial[CHUNK];                                                        \
            for (int c = 0; c < V; c++)                                                         \
                q[c] = _mm512_mul_ps(LOAD16(q_row + 16 * c), _mm512_set1_ps(scale));            \
            for (int p = 0; p < CHUNK; p++) {                                                   \
                partial[p] = _mm512_setzero_ps();                                               \
                if (p < count)                                                                  \
                    for (int c = 0; c < V; c++)                                                 \
                        partial[p] = _mm512_fmadd_ps(q[c], _mm512_load_ps(keys[p] + 16 * c),    \
                                                     partial[p]);                               \
            }                                                                                   \
            const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,          \
                                                     lane_sums16(partial));                     \
            const float block_max = fmaxf(running_max[g], _mm512_reduce_max_ps(scores));        \
            const float rescale =                                                               \
                _mm512_cvtss_f32(exp_nonpositive16(_mm512_set1_ps(running_max[g] - block_max)));\
            const __m512 w = _mm512_maskz_mov_ps(                                               \
                valid, exp_nonpositive16(_mm512_sub_ps(scores, _mm512_set1_ps(block_max))));    \
            running_sum[g] = running_sum[g] * rescale + _mm512_reduce_add_ps(w);                \
            running_max[g] = block_max;                                                         \
            _mm512_store_ps(weights, w);                                                        \
            __m512 sum[V];                                                                      \
            for (int c = 0; c < V; c++)                                                         \
                sum[c] = _mm512_mul_ps(_mm512_load_ps(acc[g] + 16 * c), _mm512_set1_ps(rescale));\
            for (int64_t p = 0; p < count; p++)                                                 \
                for (int c = 0; c < V; c++)                                                     \
                    sum[c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[p]),                        \
                                             _mm512_load_ps(values[p] + 16 * c), sum[c]);       \
            for (int c = 0; c < V; c++) _mm512_store_ps(acc[g] + 16 * c, sum[c]);               \
        }                                                                                       \
    }                                                                                           \
    for (int64_t g = 0; g < group; g++) {                                                       \
        if (state) { /* a part of the context: its softmax state, merged by the caller */       \
            memcpy(state + g * (D + 2), acc[g], sizeof acc[g]);                                 \
            state[g * (D + 2) + D] = running_max[g];                                            \
            state[g * (D + 2) + D + 1] = running_sum[g];                                        \
            continue;                                                                           \
        }                                                                                       \
        const float inverse = 1.0f / running_sum[g];                                            \
        for (int d = 0; d < D; d++) out[g * D + d] = STORE(acc[g][d] * inverse);                \
    }                                                                                           \
}

DEFINE_ITEM(item_f32_64, float, load16_f32, f32_store, 64)
DEFINE_ITEM(item_bf16_64, uint16_t, load16_bf16, bf16_store, 64)
DEFINE_ITEM(item_f32_128, float, load16_f32, f32_store, 128)
DEFINE_ITEM(item_bf16_128, uint16_t, load16_bf16, bf16_store, 128)
#define VECTOR_ITEM(NAME) NAME
#else
#define VECTOR_ITEM(NAME) NULL
#endif

/* Fewer (token, kv head) work items than twice the threads (batch 1: three items of the
   embedded model on two threads, one thread idle a third of the time): each item's context is
   cut into parts of whole chunks, every part attended to on its own (its softmax state in
   fp32), and the parts of an item merged:
     out = Σ_p e^(max_p − M)·acc_p / Σ_p e^(max_p − M)·sum_p, M the largest max_p.
   Evaluates to 0 where the items are enough (or the scratch cannot be had): the caller runs
   them whole. A statement-expression macro, as DEFINE_DECODE's element type varies: its
   OpenMP pragma reads the caller's `num_threads`. */
#define SPLIT_MIN_POSITIONS 256 /* a part of the longest context spans at least this many */
#define MAX_SPLITS 8
#define SPLIT_ALIGN 16 /* parts begin at multiples of this (the vector item's chunk) */
#define split_items(ITEM_FN, query, q_token_stride, q_head_stride, kv_cache, value_cache, row,  \
                    block_table, bt_stride, token_rows, token_requests, token_seq_lens,         \
                    num_tokens, num_heads, num_kv_heads, head_dim, block_size, scale, out,      \
                    num_threads, STORE)                                                         \
    ({                                                                                          \
        const int64_t items_ = (num_tokens) * (num_kv_heads);                                   \
        const int64_t group_ = (num_heads) / (num_kv_heads);                                    \
        int64_t splits_ = items_ > 0 ? (2 * (num_threads) + items_ - 1) / items_ : 1;           \
        int64_t longest_ = 0;                                                                   \
        for (int64_t t_ = 0; splits_ > 1 && t_ < (num_tokens); t_++)                            \
            if ((token_seq_lens)[t_] > longest_) longest_ = (token_seq_lens)[t_];               \
        if (splits_ > MAX_SPLITS) splits_ = MAX_SPLITS;                                         \
        if (splits_ > longest_ / SPLIT_MIN_POSITIONS) splits_ = longest_ / SPLIT_MIN_POSITIONS; \
        const int64_t width_ = group_ * ((head_dim) + 2); /* one part's state */                \
        float *parts_ = splits_ > 1 ? malloc(sizeof(float) * items_ * splits_ * width_) : NULL; \
        if (parts_) {                                                                           \
            _Pragma("omp parallel for schedule(static) num_threads(num_threads)")               \
            for (int64_t i_ = 0; i_ < items_ * splits_; i_++) {                                 \
                const int64_t t_ = i_ / splits_ / (num_kv_heads);                               \
                const int64_t h_ = i_ / splits_ % (num_kv_heads), p_ = i_ % splits_;            \
                const int64_t context_ = (token_seq_lens)[t_];                                  \
                /* part p_: chunks [p_·n / splits, (p_ + 1)·n / splits) of the context's n */   \
                const int64_t chunks_ = (context_ + SPLIT_ALIGN - 1) / SPLIT_ALIGN;             \
                int64_t begin_ = p_ * chunks_ / splits_ * SPLIT_ALIGN;                          \
                int64_t end_ = (p_ + 1) * chunks_ / splits_ * SPLIT_ALIGN;                      \
                if (end_ > context_) end_ = context_;                                           \
                float *state_ = parts_ + i_ * width_;                                           \
                if (begin_ >= end_) { /* an empty part: zeros (weight 0 times heap garbage      \
                                         could be NaN), a max of -inf, a sum of 0 */            \
                    memset(state_, 0, sizeof(float) * width_);                                  \
                    for (int64_t g_ = 0; g_ < group_; g_++)                                     \
                        state_[g_ * ((head_dim) + 2) + (head_dim)] = -INFINITY;                 \
                    continue;                                                                   \
                }                                                                               \
                ITEM_FN((query) + (token_rows)[t_] * (q_token_stride) +                         \
                            h_ * group_ * (q_head_stride),                                      \
                        (q_head_stride), (kv_cache) + h_ * (head_dim),                          \
                        (value_cache) + h_ * (head_dim), (row),                                 \
                        (block_table) + (token_requests)[t_] * (bt_stride), begin_, end_,       \
                        (block_size), group_, (scale), NULL, state_);                           \
            }                                                                                   \
            for (int64_t i_ = 0; i_ < items_; i_++) {                                           \
                const int64_t t_ = i_ / (num_kv_heads), h_ = i_ % (num_kv_heads);               \
                for (int64_t g_ = 0; g_ < group_; g_++) {                                       \
                    const float *first_ = parts_ + i_ * splits_ * width_ + g_ * ((head_dim) + 2); \
                    float largest_ = -INFINITY, total_ = 0.0f, weights_[MAX_SPLITS];            \
                    for (int64_t p_ = 0; p_ < splits_; p_++)                                    \
                        largest_ = fmaxf(largest_, first_[p_ * width_ + (head_dim)]);           \
                    for (int64_t p_ = 0; p_ < splits_; p_++) {                                  \
                        const float *part_ = first_ + p_ * width_;                              \
                        weights_[p_] = part_[(head_dim) + 1] > 0.0f                             \
                                           ? exp_nonpositive(part_[(head_dim)] - largest_)      \
                                           : 0.0f;                                              \
                        total_ += weights_[p_] * part_[(head_dim) + 1];                         \
                    }                                                                           \
                    __typeof__(out) dst_ =                                                      \
                        (out) + ((token_rows)[t_] * (num_heads) + h_ * group_ + g_) * (head_dim); \
                    for (int64_t d_ = 0; d_ < (head_dim); d_++) {                               \
                        float sum_ = 0.0f;                                                      \
                        for (int64_t p_ = 0; p_ < splits_; p_++)                                \
                            sum_ += weights_[p_] * first_[p_ * width_ + d_];                    \
                        dst_[d_] = STORE(sum_ / total_);                                        \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            free(parts_);                                                                       \
        }                                                                                       \
        parts_ != NULL;                                                                         \
    })

/* DEFINE_DECODE(name, element type, load, store): one kernel per cache dtype.
   query [tokens, heads, head_dim] with strides (q_token_stride, q_head_stride, 1);
   kv_cache [2, num_blocks, block_size, kv_heads, head_dim] contiguous;
   block_table [requests, bt_stride] int64; per decode token: its row of query/out, its
   request, its context length; out [tokens, heads, head_dim] contiguous. */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, HEAD_DIM, ITEM)                                      \
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
    void (*item)(const T *, int64_t, const T *, const T *, int64_t, const int64_t *, int64_t,   \
                 int64_t, int64_t, int64_t, float, T *, float *) = ITEM;                        \
    if (item && split_items(item, query, q_token_stride, q_head_stride, kv_cache, value_cache,  \
                            row, block_table, bt_stride, token_rows, token_requests,            \
                            token_seq_lens, num_tokens, num_heads, num_kv_heads, head_dim,      \
                            block_size, scale, out, num_threads, STORE))                        \
        return;                                                                                 \
    _Pragma("omp parallel for collapse(2) schedule(static) num_threads(num_threads)")           \
    for (int64_t t = 0; t < num_tokens; t++) {                                                  \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                            \
            if (item) {                                                                         \
                item(query + token_rows[t] * q_token_stride + h * group * q_head_stride,        \
                     q_head_stride, kv_cache + h * head_dim, value_cache + h * head_dim, row,   \
                     block_table + token_requests[t] * bt_stride, 0, token_seq_lens[t],         \
                     block_size, group, scale,                                                  \
                     out + (token_rows[t] * num_heads + h * group) * head_dim, NULL);           \
                continue;                                                                       \
            }                                                                                   \
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
DEFINE_DECODE(paged_decode_attention_f32, float, f32_load, f32_store, 0, NULL)
DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, bf16_load, bf16_store, 0, NULL)
DEFINE_DECODE(paged_decode_attention_f32_64, float, f32_load, f32_store, 64,
              VECTOR_ITEM(item_f32_64))
DEFINE_DECODE(paged_decode_attention_bf16_64, uint16_t, bf16_load, bf16_store, 64,
              VECTOR_ITEM(item_bf16_64))
DEFINE_DECODE(paged_decode_attention_f32_128, float, f32_load, f32_store, 128,
              VECTOR_ITEM(item_f32_128))
DEFINE_DECODE(paged_decode_attention_bf16_128, uint16_t, bf16_load, bf16_store, 128,
              VECTOR_ITEM(item_bf16_128))
