/* Decode attention over the paged KV cache, read in place (no gathered copy of each context).

   A run is a request's consecutive query tokens in the step: its one decode token, or the
   tokens verifying its drafts, each attending to the positions up to its own. One work item is
   (run, kv head): all the run's query heads of that kv head (its tokens × the GQA group)
   attend together, chunk by chunk through the request's block table, with an online softmax
   in fp32, so each key and value is read from the cache and widened once for all of them (token
   by token, a run of k tokens read its context k times). Items are spread over OpenMP
   threads; the library links the libgomp torch already loaded, so it shares torch's thread
   pool. Built by cpu_kernel.py for the machine it runs on, with reassociation allowed
   (vectorized reductions) but not -ffast-math, whose start-up code would set flush-to-zero for
   the whole process. */

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "element_types.h"
#include "kernels.h"
#include "vector_math.h"

#define MAX_QUERIES 32 /* query heads in one work item: a run's tokens × the GQA group */
#define MAX_HEAD_DIM 256
#define CHUNK 16 /* keys and values widened to fp32 at a time, all within one block */

/* What every work item of a call shares (strides in elements). */
typedef struct {
    int64_t q_token_stride, q_head_stride, out_token_stride;
    int64_t row; /* one cache position's keys, all kv heads: num_kv_heads × head_dim */
    int64_t block_size, group, head_dim;
    float scale;
} Layout;

/* One work item: a run's query heads of one kv head over the positions [begin, end) of its
   context. `query` and `out` point at the kv head's first query head of token row 0, `keys`
   and `values` at the kv head in the cache. `state` NULL: the normalized output to `out`;
   else each query head's unnormalized sums, running max and sum (head_dim + 2 floats) to
   `state`, for the caller to merge with the other parts. */
typedef struct {
    const void *query, *keys, *values;
    const int64_t *blocks; /* the request's block table row */
    const int64_t *rows;   /* the run's rows of query and out */
    const int64_t *lens;   /* each one's context length */
    int64_t num_rows, begin, end;
    void *out;
    float *state;
} Item;

typedef void (*ItemFn)(const Layout *, const Item *);

/* The chunk at position `start`: up to CHUNK positions before `context`, within one block.
   Returns its count; `slot` its first position's slot in the cache. */
static inline int64_t chunk_at(const int64_t *blocks, int64_t start, int64_t context,
                               int64_t block_size, int64_t *slot) {
    const int64_t in_block = start % block_size;
    *slot = blocks[start / block_size] * block_size + in_block;
    const int64_t count = context - start < CHUNK ? context - start : CHUNK;
    return count < block_size - in_block ? count : block_size - in_block;
}

/* The chunk at `start` (returns its count, `slot` its first position's slot) and the next one,
   to fetch while this one is read (`ahead` its count, 0 past `context`; `next_slot`). */
static inline int64_t chunk_and_next(const int64_t *blocks, int64_t start, int64_t context,
                                     int64_t block_size, int64_t *slot, int64_t *ahead,
                                     int64_t *next_slot) {
    const int64_t count = chunk_at(blocks, start, context, block_size, slot);
    *ahead = start + count < context
                 ? chunk_at(blocks, start + count, context, block_size, next_slot)
                 : 0;
    return count;
}

/* A run's context limits per query head within [begin, end); returns the largest. */
static inline int64_t query_limits(const Layout *L, const Item *it, int64_t limit[MAX_QUERIES]) {
    int64_t context = it->begin;
    for (int64_t j = 0; j < it->num_rows * L->group; j++) {
        const int64_t len = it->lens[j / L->group];
        limit[j] = len < it->end ? len : it->end;
        if (limit[j] > context) context = limit[j];
    }
    return context;
}

/* A query head's softmax state, or its normalized output. */
#define FINISH_QUERIES(T, STORE, D)                                                             \
    for (int64_t j = 0; j < queries; j++) {                                                     \
        if (it->state) {                                                                        \
            float *state = it->state + j * (D + 2);                                             \
            memcpy(state, acc[j], sizeof(float) * D);                                           \
            state[D] = running_max[j];                                                          \
            state[D + 1] = running_sum[j];                                                      \
            continue;                                                                           \
        }                                                                                       \
        T *dst = (T *)it->out + it->rows[j / L->group] * L->out_token_stride +                  \
                 j % L->group * D;                                                              \
        const float inverse = 1.0f / running_sum[j];                                            \
        for (int64_t d = 0; d < D; d++) dst[d] = STORE(acc[j][d] * inverse);                    \
    }

/* Fetches a cache position's key and value rows ahead of their use. */
static inline void prefetch_position(const char *key, const char *value, int64_t bytes) {
    prefetch_bytes(key, bytes);
    prefetch_bytes(value, bytes);
}

/* The scalar item, for any element type, and any head size (HEAD_DIM 0) or one compiled as a
   constant: loops the compiler vectorizes. */
#define DEFINE_SCALAR_ITEM(NAME, T, LOAD, STORE, HEAD_DIM)                                      \
static void NAME(const Layout *L, const Item *it) {                                             \
    enum { WIDTH = HEAD_DIM > 0 ? HEAD_DIM : MAX_HEAD_DIM };                                    \
    const int64_t D = HEAD_DIM > 0 ? HEAD_DIM : L->head_dim;                                    \
    const int64_t queries = it->num_rows * L->group;                                            \
    float q[MAX_QUERIES][WIDTH], acc[MAX_QUERIES][WIDTH];                                       \
    float keys[CHUNK][WIDTH], values[CHUNK][WIDTH], scores[CHUNK];                              \
    float running_max[MAX_QUERIES], running_sum[MAX_QUERIES];                                   \
    int64_t limit[MAX_QUERIES];                                                                 \
    const int64_t context = query_limits(L, it, limit);                                         \
    for (int64_t j = 0; j < queries; j++) {                                                     \
        const T *src = (const T *)it->query + it->rows[j / L->group] * L->q_token_stride +      \
                       j % L->group * L->q_head_stride;                                         \
        for (int64_t d = 0; d < D; d++) q[j][d] = LOAD(src[d]) * L->scale;                      \
        memset(acc[j], 0, sizeof(float) * D);                                                   \
        running_max[j] = -INFINITY;                                                             \
        running_sum[j] = 0.0f;                                                                  \
    }                                                                                           \
    int64_t count, slot, ahead, next_slot = 0;                                                  \
    for (int64_t start = it->begin; start < context; start += count) {                          \
        count = chunk_and_next(it->blocks, start, context, L->block_size, &slot, &ahead,        \
                               &next_slot);                                                     \
        for (int64_t p = 0; p < ahead; p++)                                                     \
            prefetch_position((const char *)((const T *)it->keys + (next_slot + p) * L->row),   \
                              (const char *)((const T *)it->values + (next_slot + p) * L->row), \
                              D * (int64_t)sizeof(T));                                          \
        for (int64_t p = 0; p < count; p++) {                                                   \
            const T *key = (const T *)it->keys + (slot + p) * L->row;                           \
            const T *value = (const T *)it->values + (slot + p) * L->row;                       \
            for (int64_t d = 0; d < D; d++) {                                                   \
                keys[p][d] = LOAD(key[d]);                                                      \
                values[p][d] = LOAD(value[d]);                                                  \
            }                                                                                   \
        }                                                                                       \
        for (int64_t j = 0; j < queries; j++) {                                                 \
            if (start >= limit[j]) continue;                                                    \
            const int64_t n = limit[j] - start < count ? limit[j] - start : count;              \
            float block_max = running_max[j];                                                   \
            for (int64_t p = 0; p < n; p++) {                                                   \
                float dot = 0.0f;                                                               \
                _Pragma("omp simd reduction(+:dot)")                                            \
                for (int64_t d = 0; d < D; d++) dot += q[j][d] * keys[p][d];                    \
                scores[p] = dot;                                                                \
                block_max = dot > block_max ? dot : block_max;                                  \
            }                                                                                   \
            const float rescale = exp_nonpositive(running_max[j] - block_max);                  \
            float block_sum = 0.0f;                                                             \
            for (int64_t d = 0; d < D; d++) acc[j][d] *= rescale;                               \
            for (int64_t p = 0; p < n; p++) {                                                   \
                const float weight = exp_nonpositive(scores[p] - block_max);                    \
                block_sum += weight;                                                            \
                _Pragma("omp simd")                                                             \
                for (int64_t d = 0; d < D; d++) acc[j][d] += weight * values[p][d];             \
            }                                                                                   \
            running_sum[j] = running_sum[j] * rescale + block_sum;                              \
            running_max[j] = block_max;                                                         \
        }                                                                                       \
    }                                                                                           \
    FINISH_QUERIES(T, STORE, D)                                                                 \
}

DEFINE_SCALAR_ITEM(scalar_item_f32, float, f32_load, f32_store, 0)
DEFINE_SCALAR_ITEM(scalar_item_bf16, uint16_t, bf16_load, bf16_store, 0)

#if defined(__AVX512F__)
#include <immintrin.h>

/* The head sizes compiled as constants take a vector path on AVX-512: keys in chunks of 16,
   each query head's 16 dot products left as 16 vectors of partial sums and folded into one
   vector of 16 scores at once (46 shuffles and adds, where 16 separate horizontal sums were
   the kernel's bottleneck), the softmax over the chunk's 16 lanes, and each head's output
   accumulated in registers. */

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

#define DEFINE_VECTOR_ITEM(NAME, T, LOAD16, STORE, D)                                           \
static void NAME(const Layout *L, const Item *it) {                                             \
    enum { V = D / 16 };                                                                        \
    const int64_t queries = it->num_rows * L->group;                                            \
    const T *key_cache = it->keys, *value_cache = it->values;                                   \
    float keys[CHUNK][D] __attribute__((aligned(64)));                                          \
    float values[CHUNK][D] __attribute__((aligned(64)));                                        \
    float q[MAX_QUERIES][D] __attribute__((aligned(64)));                                       \
    float acc[MAX_QUERIES][D] __attribute__((aligned(64)));                                     \
    float weights[CHUNK] __attribute__((aligned(64)));                                          \
    float running_max[MAX_QUERIES], running_sum[MAX_QUERIES];                                   \
    int64_t limit[MAX_QUERIES];                                                                 \
    const int64_t context = query_limits(L, it, limit);                                         \
    for (int64_t j = 0; j < queries; j++) {                                                     \
        const T *src = (const T *)it->query + it->rows[j / L->group] * L->q_token_stride +      \
                       j % L->group * L->q_head_stride;                                         \
        for (int c = 0; c < V; c++)                                                             \
            _mm512_store_ps(q[j] + 16 * c,                                                      \
                            _mm512_mul_ps(LOAD16(src + 16 * c), _mm512_set1_ps(L->scale)));     \
        memset(acc[j], 0, sizeof acc[j]);                                                       \
        running_max[j] = -INFINITY;                                                             \
        running_sum[j] = 0.0f;                                                                  \
    }                                                                                           \
    int64_t count, slot, ahead, next_slot = 0;                                                  \
    for (int64_t start = it->begin; start < context; start += count) {                          \
        /* The next chunk's rows are fetched while this one's are widened, a row each. */      \
        count = chunk_and_next(it->blocks, start, context, L->block_size, &slot, &ahead,        \
                               &next_slot);                                                     \
        for (int64_t p = 0; p < count || p < ahead; p++) {                                      \
            if (p < ahead)                                                                      \
                prefetch_position((const char *)(key_cache + (next_slot + p) * L->row),         \
                                  (const char *)(value_cache + (next_slot + p) * L->row),       \
                                  D * (int64_t)sizeof(T));                                      \
            if (p < count)                                                                      \
                for (int c = 0; c < V; c++) {                                                   \
                    _mm512_store_ps(keys[p] + 16 * c,                                           \
                                    LOAD16(key_cache + (slot + p) * L->row + 16 * c));          \
                    _mm512_store_ps(values[p] + 16 * c,                                         \
                                    LOAD16(value_cache + (slot + p) * L->row + 16 * c));        \
                }                                                                               \
        }                                                                                       \
        for (int64_t j = 0; j < queries; j++) {                                                 \
            if (start >= limit[j]) continue;                                                    \
            const int64_t n = limit[j] - start < count ? limit[j] - start : count;              \
            const __mmask16 valid = (__mmask16)((1u << n) - 1);                                 \
            __m512 qj[V], partial[CHUNK];                                                       \
            for (int c = 0; c < V; c++) qj[c] = _mm512_load_ps(q[j] + 16 * c);                  \
            for (int p = 0; p < CHUNK; p++) {                                                   \
                partial[p] = _mm512_setzero_ps();                                               \
                if (p < n)                                                                      \
                    for (int c = 0; c < V; c++)                                                 \
                        partial[p] = _mm512_fmadd_ps(qj[c], _mm512_load_ps(keys[p] + 16 * c),   \
                                                     partial[p]);                               \
            }                                                                                   \
            const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,          \
                                                     lane_sums16(partial));                     \
            const float block_max = fmaxf(running_max[j], _mm512_reduce_max_ps(scores));        \
            const float rescale =                                                               \
                _mm512_cvtss_f32(exp_nonpositive16(_mm512_set1_ps(running_max[j] - block_max)));\
            const __m512 w = _mm512_maskz_mov_ps(                                               \
                valid, exp_nonpositive16(_mm512_sub_ps(scores, _mm512_set1_ps(block_max))));    \
            running_sum[j] = running_sum[j] * rescale + _mm512_reduce_add_ps(w);                \
            running_max[j] = block_max;                                                         \
            _mm512_store_ps(weights, w);                                                        \
            __m512 sum[V];                                                                      \
            for (int c = 0; c < V; c++)                                                         \
                sum[c] = _mm512_mul_ps(_mm512_load_ps(acc[j] + 16 * c), _mm512_set1_ps(rescale));\
            for (int64_t p = 0; p < n; p++)                                                     \
                for (int c = 0; c < V; c++)                                                     \
                    sum[c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[p]),                        \
                                             _mm512_load_ps(values[p] + 16 * c), sum[c]);       \
            for (int c = 0; c < V; c++) _mm512_store_ps(acc[j] + 16 * c, sum[c]);               \
        }                                                                                       \
    }                                                                                           \
    FINISH_QUERIES(T, STORE, D)                                                                 \
}

DEFINE_VECTOR_ITEM(vector_item_f32_64, float, load16_f32, f32_store, 64)
DEFINE_VECTOR_ITEM(vector_item_bf16_64, uint16_t, load16_bf16, bf16_store, 64)
DEFINE_VECTOR_ITEM(vector_item_f32_128, float, load16_f32, f32_store, 128)
DEFINE_VECTOR_ITEM(vector_item_bf16_128, uint16_t, load16_bf16, bf16_store, 128)
#define VECTOR_ITEM(NAME, FALLBACK) NAME
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2's version of the vector item: 8 lanes, the chunk's 16 keys scored as two sets of 8
   partial-sum vectors, each folded into 8 scores by horizontal adds (the scalar item's
   vectorized dot product ends each position in a horizontal sum of its own: 1.4–2.0× slower
   per call on an AVX2 EPYC). */

/* sums[p] = Σ lanes of v[p], p < 8. */
static inline __m256 lane_sums8(const __m256 v[8]) {
    const __m256 pairs[4] = {_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]),
                             _mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7])};
    /* Each 128-bit half: the quads' sums of its half of v[0..3] (then v[4..7]). */
    const __m256 low = _mm256_hadd_ps(pairs[0], pairs[1]);
    const __m256 high = _mm256_hadd_ps(pairs[2], pairs[3]);
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                         _mm256_permute2f128_ps(low, high, 0x31));
}

/* exp_nonpositive (vector_math.h) over 8 lanes: the same polynomial. */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 y = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)),
                                   _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_floor_ps(_mm256_add_ps(y, _mm256_set1_ps(0.5f)));
    const __m256 f = _mm256_sub_ps(y, n);
    __m256 p = _mm256_set1_ps(EXP2_POLYNOMIAL[0]);
    for (int i = 1; i < EXP2_DEGREE + 1; i++)
        p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLYNOMIAL[i]));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

static inline float reduce_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float reduce_add8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#define DEFINE_VECTOR_ITEM(NAME, T, LOAD8, STORE, D)                                            \
static void NAME(const Layout *L, const Item *it) {                                             \
    enum { V = D / 8, HALF = CHUNK / 2 };                                                       \
    const int64_t queries = it->num_rows * L->group;                                            \
    const T *key_cache = it->keys, *value_cache = it->values;                                   \
    float keys[CHUNK][D] __attribute__((aligned(32)));                                          \
    float values[CHUNK][D] __attribute__((aligned(32)));                                        \
    float q[MAX_QUERIES][D] __attribute__((aligned(32)));                                       \
    float acc[MAX_QUERIES][D] __attribute__((aligned(32)));                                     \
    float weights[CHUNK] __attribute__((aligned(32)));                                          \
    float running_max[MAX_QUERIES], running_sum[MAX_QUERIES];                                   \
    int64_t limit[MAX_QUERIES];                                                                 \
    const int64_t context = query_limits(L, it, limit);                                         \
    for (int64_t j = 0; j < queries; j++) {                                                     \
        const T *src = (const T *)it->query + it->rows[j / L->group] * L->q_token_stride +      \
                       j % L->group * L->q_head_stride;                                         \
        for (int c = 0; c < V; c++)                                                             \
            _mm256_store_ps(q[j] + 8 * c,                                                       \
                            _mm256_mul_ps(LOAD8(src + 8 * c), _mm256_set1_ps(L->scale)));       \
        memset(acc[j], 0, sizeof acc[j]);                                                       \
        running_max[j] = -INFINITY;                                                             \
        running_sum[j] = 0.0f;                                                                  \
    }                                                                                           \
    int64_t count, slot, ahead, next_slot = 0;                                                  \
    for (int64_t start = it->begin; start < context; start += count) {                          \
        count = chunk_and_next(it->blocks, start, context, L->block_size, &slot, &ahead,        \
                               &next_slot);                                                     \
        for (int64_t p = 0; p < count || p < ahead; p++) {                                      \
            if (p < ahead)                                                                      \
                prefetch_position((const char *)(key_cache + (next_slot + p) * L->row),         \
                                  (const char *)(value_cache + (next_slot + p) * L->row),       \
                                  D * (int64_t)sizeof(T));                                      \
            if (p < count)                                                                      \
                for (int c = 0; c < V; c++) {                                                   \
                    _mm256_store_ps(keys[p] + 8 * c,                                            \
                                    LOAD8(key_cache + (slot + p) * L->row + 8 * c));            \
                    _mm256_store_ps(values[p] + 8 * c,                                          \
                                    LOAD8(value_cache + (slot + p) * L->row + 8 * c));          \
                }                                                                               \
        }                                                                                       \
        for (int64_t j = 0; j < queries; j++) {                                                 \
            if (start >= limit[j]) continue;                                                    \
            const int64_t n = limit[j] - start < count ? limit[j] - start : count;              \
            __m256 scores[2], w[2], valid[2];                                                   \
            for (int h = 0; h < 2; h++) {                                                       \
                __m256 partial[HALF];                                                           \
                for (int p = 0; p < HALF; p++) {                                                \
                    partial[p] = _mm256_setzero_ps();                                           \
                    if (h * HALF + p < n)                                                       \
                        for (int c = 0; c < V; c++)                                             \
                            partial[p] = _mm256_fmadd_ps(_mm256_load_ps(q[j] + 8 * c),          \
                                                         _mm256_load_ps(keys[h * HALF + p] +    \
                                                                        8 * c),                 \
                                                         partial[p]);                           \
                }                                                                               \
                valid[h] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(                              \
                    _mm256_set1_epi32((int)n - h * HALF),                                       \
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));                                \
                scores[h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), lane_sums8(partial),    \
                                             valid[h]);                                         \
            }                                                                                   \
            const float block_max =                                                             \
                fmaxf(running_max[j], reduce_max8(_mm256_max_ps(scores[0], scores[1])));        \
            const float rescale = _mm256_cvtss_f32(                                             \
                exp_nonpositive8(_mm256_set1_ps(running_max[j] - block_max)));                  \
            for (int h = 0; h < 2; h++) {                                                       \
                w[h] = _mm256_and_ps(valid[h], exp_nonpositive8(_mm256_sub_ps(                  \
                                                   scores[h], _mm256_set1_ps(block_max))));     \
                _mm256_store_ps(weights + h * HALF, w[h]);                                      \
            }                                                                                   \
            running_sum[j] = running_sum[j] * rescale + reduce_add8(_mm256_add_ps(w[0], w[1])); \
            running_max[j] = block_max;                                                         \
            __m256 sum[V];                                                                      \
            for (int c = 0; c < V; c++)                                                         \
                sum[c] = _mm256_mul_ps(_mm256_load_ps(acc[j] + 8 * c), _mm256_set1_ps(rescale));\
            for (int64_t p = 0; p < n; p++)                                                     \
                for (int c = 0; c < V; c++)                                                     \
                    sum[c] = _mm256_fmadd_ps(_mm256_set1_ps(weights[p]),                        \
                                             _mm256_load_ps(values[p] + 8 * c), sum[c]);        \
            for (int c = 0; c < V; c++) _mm256_store_ps(acc[j] + 8 * c, sum[c]);                \
        }                                                                                       \
    }                                                                                           \
    FINISH_QUERIES(T, STORE, D)                                                                 \
}

DEFINE_VECTOR_ITEM(vector_item_f32_64, float, load8_f32, f32_store, 64)
DEFINE_VECTOR_ITEM(vector_item_bf16_64, uint16_t, load8_bf16, bf16_store, 64)
DEFINE_VECTOR_ITEM(vector_item_f32_128, float, load8_f32, f32_store, 128)
DEFINE_VECTOR_ITEM(vector_item_bf16_128, uint16_t, load8_bf16, bf16_store, 128)
#define VECTOR_ITEM(NAME, FALLBACK) NAME
#else
DEFINE_SCALAR_ITEM(scalar_item_f32_64, float, f32_load, f32_store, 64)
DEFINE_SCALAR_ITEM(scalar_item_bf16_64, uint16_t, bf16_load, bf16_store, 64)
DEFINE_SCALAR_ITEM(scalar_item_f32_128, float, f32_load, f32_store, 128)
DEFINE_SCALAR_ITEM(scalar_item_bf16_128, uint16_t, bf16_load, bf16_store, 128)
#define VECTOR_ITEM(NAME, FALLBACK) FALLBACK
#endif

/* Runs of at most `max_rows` tokens: consecutive tokens of one request. `starts` gets each
   run's first token and, last, num_tokens; returns the number of runs. */
static int64_t plan_runs(const int64_t *token_requests, int64_t num_tokens, int64_t max_rows,
                         int64_t *starts) {
    int64_t runs = 0;
    for (int64_t t = 0; t < num_tokens; t++)
        if (t == 0 || token_requests[t] != token_requests[t - 1] ||
            t - starts[runs - 1] >= max_rows)
            starts[runs++] = t;
    starts[runs] = num_tokens;
    return runs;
}

/* A run's first token: without the scratch for a plan (NULL), every token is a run. */
static inline int64_t run_start(const int64_t *starts, int64_t run) {
    return starts ? starts[run] : run;
}

/* Fewer work items than twice the threads (batch 1: one per kv head, three for the embedded
   model on two threads, one thread idle a third of the time): each item's context is cut into
   parts of whole chunks, every part attended to on its own (its softmax state in fp32), and
   the parts of an item merged:
     out = Σ_p e^(max_p − M)·acc_p / Σ_p e^(max_p − M)·sum_p, M the largest max_p.
   Returns how many parts (1: whole items). */
#define SPLIT_MIN_POSITIONS 256 /* a part of the longest context spans at least this many */
#define MAX_SPLITS 8
static int64_t split_count(int64_t items, int num_threads, const int64_t *token_seq_lens,
                           int64_t num_tokens) {
    if (items <= 0 || items >= 2 * (int64_t)num_threads) return 1;
    int64_t splits = (2 * num_threads + items - 1) / items, longest = 0;
    for (int64_t t = 0; t < num_tokens; t++)
        if (token_seq_lens[t] > longest) longest = token_seq_lens[t];
    if (splits > MAX_SPLITS) splits = MAX_SPLITS;
    if (splits > longest / SPLIT_MIN_POSITIONS) splits = longest / SPLIT_MIN_POSITIONS;
    return splits > 1 ? splits : 1;
}

/* Merges each query head's parts into its output row. */
static void merge_parts(const Layout *L, const float *parts, int64_t splits, int64_t width,
                        const int64_t *starts, int64_t num_kv_heads, int64_t items,
                        const int64_t *token_rows, char *out, size_t element,
                        void (*store)(char *, float)) {
    const int64_t D = L->head_dim;
    for (int64_t i = 0; i < items; i++) {
        const int64_t run = i / num_kv_heads, h = i % num_kv_heads;
        const int64_t first = run_start(starts, run);
        const int64_t queries = (run_start(starts, run + 1) - first) * L->group;
        for (int64_t j = 0; j < queries; j++) {
            const float *head = parts + i * splits * width + j * (D + 2);
            float largest = -INFINITY, total = 0.0f, weights[MAX_SPLITS];
            for (int64_t p = 0; p < splits; p++) largest = fmaxf(largest, head[p * width + D]);
            for (int64_t p = 0; p < splits; p++) {
                const float *part = head + p * width;
                weights[p] = part[D + 1] > 0.0f ? exp_nonpositive(part[D] - largest) : 0.0f;
                total += weights[p] * part[D + 1];
            }
            char *dst = out + ((token_rows[first + j / L->group] * L->out_token_stride) +
                               (h * L->group + j % L->group) * D) * (int64_t)element;
            for (int64_t d = 0; d < D; d++) {
                float sum = 0.0f;
                for (int64_t p = 0; p < splits; p++) sum += weights[p] * head[p * width + d];
                store(dst + d * (int64_t)element, sum / total);
            }
        }
    }
}

static void store_f32(char *dst, float value) { memcpy(dst, &value, sizeof value); }
static void store_bf16(char *dst, float value) {
    const uint16_t bits = bf16_store(value);
    memcpy(dst, &bits, sizeof bits);
}

/* What the work items of one call read and write. */
typedef struct {
    const Layout *layout;
    ItemFn item;
    int64_t element; /* bytes per element */
    const char *query, *kv_cache, *value_cache;
    const int64_t *block_table, *token_rows, *token_requests, *token_seq_lens;
    int64_t bt_stride, num_kv_heads;
    const int64_t *starts; /* the runs (NULL: a run per token) */
    const int64_t *order;  /* the runs in the order attended (NULL: as planned) */
    int64_t splits, width; /* parts per item; floats of one part's states */
    char *out;
    float *parts; /* the parts' states (NULL: items whole) */
} Call;

/* Piece i: part i % splits of the kv head i / splits % num_kv_heads of a run. */
static void attend_piece(const Call *c, int64_t i) {
    const Layout *L = c->layout;
    const int64_t item = i / c->splits, part = i % c->splits, h = item % c->num_kv_heads;
    const int64_t run = c->order ? c->order[item / c->num_kv_heads] : item / c->num_kv_heads;
    const int64_t first = run_start(c->starts, run);
    const int64_t num_rows = run_start(c->starts, run + 1) - first;
    int64_t longest = 0;
    for (int64_t r = 0; r < num_rows; r++)
        if (c->token_seq_lens[first + r] > longest) longest = c->token_seq_lens[first + r];
    /* part p: chunks [p·n / splits, (p + 1)·n / splits) of the longest context's n */
    const int64_t chunks = (longest + CHUNK - 1) / CHUNK;
    const int64_t begin = part * chunks / c->splits * CHUNK;
    const int64_t end = (part + 1) * chunks / c->splits * CHUNK;
    const Item work = {
        .query = c->query + h * L->group * L->q_head_stride * c->element,
        .keys = c->kv_cache + h * L->head_dim * c->element,
        .values = c->value_cache + h * L->head_dim * c->element,
        .blocks = c->block_table + c->token_requests[first] * c->bt_stride,
        .rows = c->token_rows + first,
        .lens = c->token_seq_lens + first,
        .num_rows = num_rows,
        .begin = begin,
        .end = end < longest ? end : longest,
        .out = c->out + h * L->group * L->head_dim * c->element,
        .state = c->parts ? c->parts + i * c->width : NULL,
    };
    c->item(L, &work);
}

/* The runs by their number of tokens, most first (a counting sort), into `order`; 0 where
   every run has as many (then the planned order is kept). Static scheduling gives each thread
   a contiguous range of items, so a step's few long runs (tokens verifying drafts, short
   prompt chunks) beside many single decodes landed on one thread together. */
static int uneven_runs(const int64_t *starts, int64_t runs, int64_t max_rows, int64_t *order) {
    int64_t counts[MAX_QUERIES + 1] = {0};
    for (int64_t run = 0; run < runs; run++) counts[starts[run + 1] - starts[run]]++;
    int64_t kinds = 0;
    for (int64_t rows = 1; rows <= max_rows; rows++) kinds += counts[rows] > 0;
    if (kinds < 2) return 0;
    int64_t next[MAX_QUERIES + 1];
    for (int64_t rows = max_rows, at = 0; rows >= 1; rows--) {
        next[rows] = at;
        at += counts[rows];
    }
    for (int64_t run = 0; run < runs; run++) order[next[starts[run + 1] - starts[run]]++] = run;
    return 1;
}

/* Plans the runs and their parts, attends to them over the threads, merges split parts. */
static void attend(const Layout *L, ItemFn item, size_t element, void (*store)(char *, float),
                   const char *query, const char *kv_cache, const char *value_cache,
                   const int64_t *block_table, int64_t bt_stride, const int64_t *token_rows,
                   const int64_t *token_requests, const int64_t *token_seq_lens,
                   int64_t num_tokens, int64_t num_kv_heads, char *out, int num_threads) {
    const int64_t max_rows = MAX_QUERIES / L->group;
    if (max_rows < 1) return; /* cpu_kernel.supports() binds the torch backend to such groups */
    /* the runs' starts, then room for their order */
    int64_t *starts = num_tokens > 0 ? malloc(sizeof(int64_t) * (2 * num_tokens + 1)) : NULL;
    const int64_t runs = starts ? plan_runs(token_requests, num_tokens, max_rows, starts)
                                : num_tokens;
    const int64_t items = runs * num_kv_heads;
    Call call = {
        .layout = L, .item = item, .element = (int64_t)element, .query = query,
        .kv_cache = kv_cache, .value_cache = value_cache, .block_table = block_table,
        .token_rows = token_rows, .token_requests = token_requests,
        .token_seq_lens = token_seq_lens, .bt_stride = bt_stride, .num_kv_heads = num_kv_heads,
        .starts = starts, .out = out,
        .splits = split_count(items, num_threads, token_seq_lens, num_tokens),
        .width = (starts ? max_rows : 1) * L->group * (L->head_dim + 2),
    };
    if (call.splits > 1) {
        call.parts = malloc(sizeof(float) * items * call.splits * call.width);
        if (call.parts == NULL) call.splits = 1;
    }
    const int64_t pieces = items * call.splits;
    if (starts && call.splits == 1 && uneven_runs(starts, runs, max_rows, starts + runs + 1)) {
        call.order = starts + runs + 1; /* the longest runs first, taken as threads free up */
        #pragma omp parallel for schedule(dynamic) num_threads(num_threads)
        for (int64_t i = 0; i < pieces; i++) attend_piece(&call, i);
    } else {
        #pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t i = 0; i < pieces; i++) attend_piece(&call, i);
    }
    if (call.parts)
        merge_parts(L, call.parts, call.splits, call.width, starts, num_kv_heads, items,
                    token_rows, out, element, store);
    free(call.parts);
    free(starts);
}

/* DEFINE_DECODE(name, element type, head size or 0, item, store): one kernel per cache dtype.
   query [tokens, heads, head_dim] with strides (q_token_stride, q_head_stride, 1);
   kv_cache [2, num_blocks, block_size, kv_heads, head_dim] contiguous;
   block_table [requests, bt_stride] int64; per decode token: its row of query/out, its
   request, its context length (a request's consecutive tokens form a run); out [tokens,
   heads, head_dim] contiguous. */
#define DEFINE_DECODE(NAME, T, HEAD_DIM, ITEM, STORE)                                           \
void NAME(const T *query, int64_t q_token_stride, int64_t q_head_stride,                        \
          const T *kv_cache, int64_t num_blocks, const int64_t *block_table,                    \
          int64_t bt_stride, const int64_t *token_rows, const int64_t *token_requests,          \
          const int64_t *token_seq_lens, int64_t num_tokens, int64_t num_heads,                 \
          int64_t num_kv_heads, int64_t head_dim_arg, int64_t block_size, float scale, T *out,  \
          int num_threads) {                                                                    \
    const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_arg;                            \
    const Layout layout = {                                                                     \
        .q_token_stride = q_token_stride, .q_head_stride = q_head_stride,                       \
        .out_token_stride = num_heads * head_dim, .row = num_kv_heads * head_dim,               \
        .block_size = block_size, .group = num_heads / num_kv_heads, .head_dim = head_dim,      \
        .scale = scale,                                                                         \
    };                                                                                          \
    attend(&layout, ITEM, sizeof(T), STORE, (const char *)query, (const char *)kv_cache,        \
           (const char *)(kv_cache + num_blocks * block_size * layout.row), block_table,        \
           bt_stride, token_rows, token_requests, token_seq_lens, num_tokens, num_kv_heads,     \
           (char *)out, num_threads);                                                           \
}

/* Any head size, and the common ones as constants (fully unrolled dot products). */
DEFINE_DECODE(paged_decode_attention_f32, float, 0, scalar_item_f32, store_f32)
DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, 0, scalar_item_bf16, store_bf16)
DEFINE_DECODE(paged_decode_attention_f32_64, float, 64,
              VECTOR_ITEM(vector_item_f32_64, scalar_item_f32_64), store_f32)
DEFINE_DECODE(paged_decode_attention_bf16_64, uint16_t, 64,
              VECTOR_ITEM(vector_item_bf16_64, scalar_item_bf16_64), store_bf16)
DEFINE_DECODE(paged_decode_attention_f32_128, float, 128,
              VECTOR_ITEM(vector_item_f32_128, scalar_item_f32_128), store_f32)
DEFINE_DECODE(paged_decode_attention_bf16_128, uint16_t, 128,
              VECTOR_ITEM(vector_item_bf16_128, scalar_item_bf16_128), store_bf16)
