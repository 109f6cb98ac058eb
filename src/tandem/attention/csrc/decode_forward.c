/* A decode step from its token ids to its final hidden states in one call: no Python, no
   torch op per layer.

   At batch 1 a layer is ~25 small torch ops whose dispatch costs more than their arithmetic;
   here each layer is RMSNorm, the packed QKV matmul, RoPE, the KV store, paged attention,
   the O matmul and residual add, RMSNorm, the packed gate/up matmul, SiLU·mul, the packed
   down matmul and residual add, through the kernels the layer-by-layer path calls (their fp32
   versions for the norms and RoPE; attention in the cache's element type). The embedding
   rows, the rotary table's rows and the final RMSNorm are here too: as torch ops around the
   call they cost ~0.3 ms of a 6 ms batch-1 step on the AVX2 EPYC (the first Python and torch
   calls after the layers run with every cache emptied by the weights). The residual stream
   stays fp32 across layers; the query, keys and values are rounded to the cache's element
   type, as they are layer by layer. With `token`, a step of one token goes on through the
   packed LM head to its logits and their first argmax (packed_matmul_argmax: a greedy
   batch-1 step), saving that call's Python too; a bf16 model's head reads the final row
   rounded to bf16, as it does after the layer-by-layer path. Returns -1 where the scratch
   buffers cannot be allocated, -2 for a token id outside the vocabulary or a position outside
   the rotary table, -3 for an LM head asked of a step it cannot take, else 0. Used for steps
   whose every token is a decode token (a request's one new token, its draft-verification
   tokens, a short prompt chunk) and whose weights are all packed (worker/cpu_decode.py). */

#include <stdlib.h>
#include <string.h>

#include "element_types.h"
#include "kernels.h"
#include "vector_math.h"

typedef struct {
    const uint8_t *codes;  /* models/packed.py's kernel layout */
    const uint16_t *scales;
    int64_t quant_type;
    int64_t out_features;
    const float *bias;  /* NULL: none */
} PackedMatrix;

typedef struct {
    const float *input_norm;  /* [hidden] fp32 */
    const float *post_attention_norm;
    PackedMatrix qkv, o, gate_up, down;
    void *kv_cache;  /* [2, num_blocks, block_size, kv_heads, head_dim] of the element type */
} DecodeLayer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size;
    int64_t int8_min_tokens; /* steps of at least this many tokens: int8 activations; 0: never */
    float eps, scale;
    const DecodeLayer *layers;
    const void *embedding;  /* [vocab_size, hidden], fp32 or bf16 (a bf16 model's) */
    int64_t embedding_bf16, vocab_size;  /* embedding_bf16: the model computes in bf16 */
    const float *cos_sin;  /* [max_positions, head_dim]: cos then sin of each position */
    int64_t max_positions;
    const float *final_norm;  /* [hidden] fp32 */
    PackedMatrix head;  /* the LM head without a bias; codes NULL: none packed */
    int64_t head_int8;  /* its argmax pass quantizes the row to int8 */
} DecodeModel;

typedef struct {
    int64_t num_tokens;
    const int64_t *input_ids, *positions;  /* [num_tokens] */
    const int64_t *slot_mapping;  /* [num_tokens] cache slot; < 0: not stored */
    const int64_t *block_table;
    int64_t block_table_stride;
    const int64_t *token_rows, *token_requests, *token_seq_lens;  /* as the attention kernel */
} DecodeStep;

/* int8_scratch: packed_matmul_int8_into's scratch for int8 activations; NULL: fp32 ones. */
static void matmul(const PackedMatrix *m, int64_t k, const float *x, int64_t num_tokens,
                   float *out, void *int8_scratch, int num_threads) {
    if (int8_scratch)
        packed_matmul_int8_into(m->codes, m->scales, m->quant_type, m->out_features, k, x,
                                num_tokens, out, int8_scratch, num_threads);
    else
        packed_matmul(m->codes, m->scales, m->quant_type, m->out_features, k, x, num_tokens,
                      out, num_threads);
    if (m->bias)
        for (int64_t t = 0; t < num_tokens; t++)
            for (int64_t i = 0; i < m->out_features; i++) out[t * m->out_features + i] += m->bias[i];
}

/* out = silu(gate) * up for gate_up [tokens, 2 * size] rows of gate then up; rows over the
   threads (at batch 32, done on one thread, the other's wait was ~2% of a step). */
static void silu_and_mul(const float *gate_up, int64_t num_tokens, int64_t size, float *out,
                         int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if(num_tokens * size >= 16384)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *gate = gate_up + t * 2 * size, *up = gate + size;
        for (int64_t i = 0; i < size; i++)
            out[t * size + i] = silu(gate[i]) * up[i];
    }
}

/* -2 where a token id or a position of the step is outside its table, else 0. */
static int check_inputs(const DecodeModel *model, const DecodeStep *step) {
    for (int64_t t = 0; t < step->num_tokens; t++) {
        const int64_t id = step->input_ids[t], position = step->positions[t];
        if (id < 0 || id >= model->vocab_size || position < 0 || position >= model->max_positions)
            return -2;
    }
    return 0;
}

/* The step's embedding rows (fp32) into hidden and its positions' rotary rows into cos_sin;
   -2 where an id or a position is outside its table. */
static int gather_inputs(const DecodeModel *model, const DecodeStep *step, float *hidden,
                         float *cos_sin) {
    const int64_t width = model->hidden, head_dim = model->head_dim;
    if (check_inputs(model, step) != 0) return -2;
    for (int64_t t = 0; t < step->num_tokens; t++) {
        const int64_t id = step->input_ids[t], position = step->positions[t];
        if (model->embedding_bf16) {
            const uint16_t *row = (const uint16_t *)model->embedding + id * width;
            for (int64_t i = 0; i < width; i++) hidden[t * width + i] = bf16_load(row[i]);
        } else {
            memcpy(hidden + t * width, (const float *)model->embedding + id * width,
                   sizeof(float) * width);
        }
        memcpy(cos_sin + t * head_dim, model->cos_sin + position * head_dim,
               sizeof(float) * head_dim);
    }
    return 0;
}

/* The rows' draws at each step of a burst (sample_rows' parameters, as the sampler passes
   them; temperature 0: the argmax); NULL in its place: every row takes its argmax. */
typedef struct {
    const float *temperature, *top_p, *min_p;  /* [rows] */
    const int64_t *top_k;                      /* [rows] */
    const float *uniforms;                     /* [num_steps, rows] */
    void *scratch;                             /* sample_rows' scratch, per thread */
} RowsSampling;

/* The head's logits [rows, vocab] of the final hidden rows and each row's token, as the model
   runner's step takes them: one row through the head's argmax pass (its logits are
   compute_logits'), more through the packed matmul (int8 activations where head_int8, the
   head's own rule for that many rows), then the argmax or the sampler's draw. */
static int head_tokens(const DecodeModel *model, float *final, int64_t rows, float *logits,
                       int64_t *tokens, int64_t head_int8, const RowsSampling *sampling,
                       const float *uniforms, int num_threads) {
    const int64_t width = model->hidden, vocab = model->head.out_features;
    if (model->embedding_bf16) /* a bf16 model's head reads the rows rounded to bf16 */
        for (int64_t i = 0; i < rows * width; i++) final[i] = bf16_load(bf16_store(final[i]));
    const PackedMatrix *head = &model->head;
    if (rows == 1)
        (model->head_int8 ? packed_matmul_int8_argmax : packed_matmul_argmax)(
            head->codes, head->scales, head->quant_type, vocab, width, final, logits, tokens,
            num_threads);
    else if (head_int8) {
        if (packed_matmul_int8(head->codes, head->scales, head->quant_type, vocab, width, final,
                               rows, logits, num_threads) != 0)
            return -1;
    } else
        packed_matmul(head->codes, head->scales, head->quant_type, vocab, width, final, rows,
                      logits, num_threads);
    if (sampling)
        sample_rows(logits, rows, vocab, sampling->temperature, sampling->top_k, sampling->top_p,
                    sampling->min_p, uniforms, tokens, sampling->scratch,
                    rows < num_threads ? (int)rows : num_threads);
    else if (rows > 1)
        argmax_rows(logits, rows, vocab, tokens, num_threads);
    return 0;
}

typedef int DecodeStepFunction(const DecodeModel *, const DecodeStep *, float *, float *,
                               int64_t *, int);

/* Whether a step of this many tokens multiplies int8 activations. */
static int int8_activations(const DecodeModel *model, int64_t tokens) {
    return model->int8_min_tokens > 0 && tokens >= model->int8_min_tokens;
}

/* Steps of at least this many tokens a thread run their layers as one part per thread
   (split_step): a full pass of the packed kernels' rows each. */
#define PART_MIN_TOKENS 8
/* ... unless request boundaries leave a part this much more work than an even share. */
#define PART_MAX_SHARE 1.2

/* The layers of a step of many tokens, one part of its requests per thread, each thread
   through every layer on its own: a token's layers read only its own rows and its request's
   cache, so the parts need no barrier between them, where splitting each matrix's columns
   over the threads costs a fork and a join per kernel (~8 a layer) and, before every kernel,
   fetching the rows the other core wrote (on a 2-core Zen 4 EPYC, the waits at the joins and
   the quantization of activations waiting on those fetches were ~18% of a 32-request step).
   Each thread reads all the weights instead of its share; from PART_MIN_TOKENS tokens a
   thread the step is bound by arithmetic, not by those bytes. Parts end at the request
   boundaries nearest an even split of the tokens' matmul and attention work (a request's
   tokens read the keys its earlier tokens store in the same layer); where that leaves one
   part too much, the step runs whole, its matrices' columns over the threads. So does a
   step whose int8 products take the wide kernel (AVX2): its unpacked weights serve all the
   step's rows, and halving them per call cost more than the split saved (7% slower at 32
   requests, the AVX2 build on the Zen 4 EPYC). Returns `whole`'s status: 0, or the first
   failing part's; -2 before any part runs where a token id or position is out of range. */
static int split_step(DecodeStepFunction *whole, const DecodeModel *model,
                      const DecodeStep *step, float *final, int num_threads) {
    if (check_inputs(model, step) != 0) return -2;
    const int64_t tokens = step->num_tokens;
    const double per_position = 2.0 * model->num_heads * model->head_dim;
    const double per_token = (double)model->hidden *
        (model->num_heads * model->head_dim * 2 + model->num_kv_heads * model->head_dim * 2 +
         3 * model->intermediate);
    int64_t *rows = malloc(sizeof(int64_t) * tokens);
    double *work = malloc(sizeof(double) * (tokens + 1)); /* of the tokens before each */
    if (rows == NULL || work == NULL) {
        free(rows);
        free(work);
        return -1;
    }
    work[0] = 0.0;
    for (int64_t t = 0; t < tokens; t++)
        work[t + 1] = work[t] + per_token + per_position * step->token_seq_lens[t];
    int64_t starts[num_threads + 1];
    int parts = 0;
    starts[0] = 0;
    for (int part = 1; part < num_threads; part++) {
        const double target = work[tokens] * part / num_threads;
        int64_t nearest = -1;
        for (int64_t t = starts[parts] + 1; t < tokens; t++)
            if (step->token_requests[t] != step->token_requests[t - 1] &&
                (nearest < 0 || fabs(work[t] - target) < fabs(work[nearest] - target)))
                nearest = t;
        if (nearest > 0) starts[++parts] = nearest;
    }
    starts[++parts] = tokens;
    int even = parts > 1;
    for (int part = 0; part < parts; part++)
        even &= work[starts[part + 1]] - work[starts[part]] <=
                PART_MAX_SHARE * work[tokens] / num_threads;
    free(work);
    if (!even) {
        free(rows);
        return whole(model, step, final, NULL, NULL, num_threads);
    }
    int status[num_threads];
    #pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int part = 0; part < parts; part++) {
        const int64_t first = starts[part];
        DecodeStep sub = *step;
        sub.num_tokens = starts[part + 1] - first;
        for (int64_t t = first; t < starts[part + 1]; t++) rows[t] = step->token_rows[t] - first;
        sub.input_ids += first;
        sub.positions += first;
        sub.slot_mapping += first;
        sub.token_rows = rows + first;
        sub.token_requests += first;
        sub.token_seq_lens += first;
        status[part] = whole(model, &sub, final + first * model->hidden, NULL, NULL, 1);
    }
    free(rows);
    for (int part = 0; part < parts; part++)
        if (status[part] != 0) return status[part];
    return 0;
}

/* SUFFIX: the attention kernels' element type (f32, bf16); heads of 64 and 128 take the
   kernels compiled for them. */
#define DEFINE_DECODE_STEP(NAME, T, LOAD, STORE, SUFFIX)                                           \
static int NAME##_layers(const DecodeModel *model, const DecodeStep *step, float *final,          \
                         float *logits, int64_t *token, int num_threads) {                         \
    __typeof__(paged_decode_attention_##SUFFIX) *attention =                                       \
        model->head_dim == 64    ? paged_decode_attention_##SUFFIX##_64                            \
        : model->head_dim == 128 ? paged_decode_attention_##SUFFIX##_128                           \
                                 : paged_decode_attention_##SUFFIX;                                \
    const int64_t tokens = step->num_tokens, width = model->hidden;                                \
    const int64_t q_size = model->num_heads * model->head_dim;                                     \
    const int64_t kv_size = model->num_kv_heads * model->head_dim;                                 \
    const int64_t qkv_size = q_size + 2 * kv_size, inter = model->intermediate;                    \
    float *normed = malloc(sizeof(float) * tokens *                                                \
                           (3 * width + qkv_size + q_size + 3 * inter + model->head_dim));         \
    float *delta = normed + tokens * width, *qkv = delta + tokens * width;                         \
    float *attended = qkv + tokens * qkv_size;                                                     \
    float *gate_up = attended + tokens * q_size, *act = gate_up + tokens * 2 * inter;              \
    float *hidden = act + tokens * inter, *cos_sin = hidden + tokens * width;                      \
    T *query = malloc(sizeof(T) * tokens * 2 * q_size);                                            \
    const int int8 = int8_activations(model, tokens);                                              \
    const int64_t widest = width > q_size ? (width > inter ? width : inter)                        \
                                          : (q_size > inter ? q_size : inter);                     \
    void *scratch = int8 ? malloc(packed_matmul_int8_scratch(tokens, widest)) : NULL;              \
    const int status =                                                                             \
        normed == NULL || query == NULL || (int8 && scratch == NULL) ? -1                          \
        : token != NULL && (tokens != 1 || logits == NULL || model->head.codes == NULL) ? -3       \
        : gather_inputs(model, step, hidden, cos_sin);                                             \
    if (status != 0) goto done;                                                                    \
    T *out = query + tokens * q_size;                                                              \
    for (int64_t l = 0; l < model->num_layers; l++) {                                              \
        const DecodeLayer *layer = model->layers + l;                                              \
        T *key_cache = layer->kv_cache;                                                            \
        T *value_cache = key_cache + model->num_blocks * model->block_size * kv_size;              \
        rms_norm_f32(hidden, layer->input_norm, normed, tokens, width, model->eps, num_threads);   \
        matmul(&layer->qkv, width, normed, tokens, qkv, scratch, num_threads);                     \
        rotary_f32(qkv, qkv_size, model->num_heads + model->num_kv_heads, model->head_dim,         \
                   cos_sin, model->head_dim, tokens, num_threads);                                 \
        for (int64_t t = 0; t < tokens; t++) {                                                     \
            const float *row = qkv + t * qkv_size;                                                 \
            for (int64_t i = 0; i < q_size; i++) query[t * q_size + i] = STORE(row[i]);            \
            const int64_t slot = step->slot_mapping[t];                                            \
            if (slot < 0) continue;                                                                \
            for (int64_t i = 0; i < kv_size; i++) {                                                \
                key_cache[slot * kv_size + i] = STORE(row[q_size + i]);                            \
                value_cache[slot * kv_size + i] = STORE(row[q_size + kv_size + i]);                \
            }                                                                                      \
        }                                                                                          \
        attention(query, q_size, model->head_dim, key_cache, model->num_blocks,                    \
                  step->block_table, step->block_table_stride, step->token_rows,                   \
                  step->token_requests, step->token_seq_lens, tokens, model->num_heads,            \
                  model->num_kv_heads, model->head_dim, model->block_size, model->scale, out,      \
                  num_threads);                                                                    \
        for (int64_t i = 0; i < tokens * q_size; i++) attended[i] = LOAD(out[i]);                  \
        matmul(&layer->o, q_size, attended, tokens, delta, scratch, num_threads);                  \
        for (int64_t i = 0; i < tokens * width; i++) hidden[i] += delta[i];                        \
        rms_norm_f32(hidden, layer->post_attention_norm, normed, tokens, width, model->eps,        \
                     num_threads);                                                                 \
        matmul(&layer->gate_up, width, normed, tokens, gate_up, scratch, num_threads);             \
        silu_and_mul(gate_up, tokens, inter, act, num_threads);                                    \
        matmul(&layer->down, inter, act, tokens, delta, scratch, num_threads);                     \
        for (int64_t i = 0; i < tokens * width; i++) hidden[i] += delta[i];                        \
    }                                                                                              \
    rms_norm_f32(hidden, model->final_norm, final, tokens, width, model->eps, num_threads);        \
    if (token != NULL) head_tokens(model, final, 1, logits, token, 0, NULL, NULL, num_threads);    \
done:                                                                                              \
    free(scratch);                                                                                 \
    free(query);                                                                                   \
    free(normed);                                                                                  \
    return status;                                                                                 \
}                                                                                                  \
                                                                                                   \
int NAME(const DecodeModel *model, const DecodeStep *step, float *final, float *logits,           \
         int64_t *token, int num_threads) {                                                        \
    const int64_t tokens = step->num_tokens;                                                       \
    const int wide = int8_activations(model, tokens) && packed_matmul_int8_wide(tokens);           \
    if (num_threads > 1 && tokens >= PART_MIN_TOKENS * num_threads && token == NULL && !wide)      \
        return split_step(NAME##_layers, model, step, final, num_threads);                         \
    return NAME##_layers(model, step, final, logits, token, num_threads);                          \
}

DEFINE_DECODE_STEP(decode_step_f32, float, f32_load, f32_store, f32)
DEFINE_DECODE_STEP(decode_step_bf16, uint16_t, bf16_load, bf16_store, bf16)

/* Up to num_steps decode steps of `first`'s requests, one token each, every row fed the
   token it chose the step before, with no Python between the forwards: the inner loop of
   multi-step scheduling (worker/cpu_decode.py). Each later step is a position on for every
   row, its cache slot read from the first num_request_blocks[r] entries of row r's
   block-table row (the rest is padding). Writes the tokens to tokens [num_steps, rows] and
   ends after the step where a row's token is among its stop ids (stop_ids[stop_offsets[r] :
   stop_offsets[r + 1]]). Returns the steps it ran, or a negative status: decode_step's, or
   -4 for a position past a request's blocks. */
static int decode_steps(DecodeStepFunction *one_step, const DecodeModel *model,
                        const DecodeStep *first, float *final, float *logits, int64_t *tokens,
                        const int64_t *num_request_blocks, int64_t num_steps,
                        const int64_t *stop_ids, const int64_t *stop_offsets, int64_t head_int8,
                        const RowsSampling *sampling, int num_threads) {
    const int64_t rows = first->num_tokens, stride = first->block_table_stride;
    if (model->head.codes == NULL) return -3;
    int64_t *state = malloc(sizeof(int64_t) * 4 * rows);
    if (state == NULL) return -1;
    int64_t *ids = state, *positions = ids + rows, *slots = positions + rows;
    int64_t *seq_lens = slots + rows;
    DecodeStep step = *first;
    step.input_ids = ids;
    step.positions = positions;
    step.slot_mapping = slots;
    step.token_seq_lens = seq_lens;
    int status = 0;
    for (int64_t r = 0; r < rows; r++) {
        ids[r] = first->input_ids[r];
        positions[r] = first->positions[r];
        slots[r] = first->slot_mapping[r];
        seq_lens[r] = first->token_seq_lens[r];
        if (num_request_blocks[r] > stride) status = -4;
    }
    int64_t s = 0;
    for (; status == 0 && s < num_steps; s++) {
        for (int64_t r = 0; s > 0 && r < rows; r++) {
            const int64_t *blocks = first->block_table + first->token_requests[r] * stride;
            const int64_t block = ++positions[r] / model->block_size;
            if (block >= num_request_blocks[r] || blocks[block] < 0 ||
                blocks[block] >= model->num_blocks) {
                status = -4;
                break;
            }
            ids[r] = tokens[(s - 1) * rows + r];
            seq_lens[r]++;
            slots[r] = blocks[block] * model->block_size + positions[r] % model->block_size;
        }
        if (status != 0) break;
        status = one_step(model, &step, final, NULL, NULL, num_threads);
        if (status == 0)
            status = head_tokens(model, final, rows, logits, tokens + s * rows, head_int8,
                                 sampling, sampling ? sampling->uniforms + s * rows : NULL,
                                 num_threads);
        int stopped = 0;
        for (int64_t r = 0; status == 0 && r < rows; r++)
            for (int64_t i = stop_offsets[r]; i < stop_offsets[r + 1]; i++)
                stopped |= tokens[s * rows + r] == stop_ids[i];
        if (stopped) {
            s++;
            break;
        }
    }
    free(state);
    return status != 0 ? status : (int)s;
}

#define DEFINE_DECODE_STEPS(NAME, ONE_STEP)                                                        \
int NAME(const DecodeModel *model, const DecodeStep *first, float *final, float *logits,          \
         int64_t *tokens, const int64_t *num_request_blocks, int64_t num_steps,                    \
         const int64_t *stop_ids, const int64_t *stop_offsets, int64_t head_int8,                  \
         const RowsSampling *sampling, int num_threads) {                                          \
    return decode_steps(ONE_STEP, model, first, final, logits, tokens, num_request_blocks,         \
                        num_steps, stop_ids, stop_offsets, head_int8, sampling, num_threads);      \
}

DEFINE_DECODE_STEPS(decode_steps_f32, decode_step_f32)
DEFINE_DECODE_STEPS(decode_steps_bf16, decode_step_bf16)
