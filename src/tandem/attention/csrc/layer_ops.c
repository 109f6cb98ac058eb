/* A decoder layer's small element-wise ops, one call each instead of several torch ops (at
   batch 1 each torch op costs more in dispatch than in arithmetic). Same arithmetic as their
   torch versions in models/layers.py: fp32 throughout, rounded once to the element type; no
   FMA contraction (-ffp-contract=off), so RoPE is bit-identical to the torch version. */

#include "element_types.h"

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, rows of `size` contiguous elements. */
#define DEFINE_RMS_NORM(NAME, T, LOAD, STORE)                                                   \
void NAME(const T *x, const T *weight, T *out, int64_t rows, int64_t size, float eps,           \
          int num_threads) {                                                                    \
    _Pragma("omp parallel for num_threads(num_threads) if(rows * size >= 65536)")              \
    for (int64_t r = 0; r < rows; r++) {                                                        \
        const T *row = x + r * size;                                                            \
        float sum = 0.0f;                                                                       \
        _Pragma("omp simd reduction(+:sum)")                                                    \
        for (int64_t i = 0; i < size; i++) sum += LOAD(row[i]) * LOAD(row[i]);                  \
        const float inverse = 1.0f / sqrtf(sum / (float)size + eps);                            \
        for (int64_t i = 0; i < size; i++)                                                      \
            out[r * size + i] = STORE(LOAD(row[i]) * inverse * LOAD(weight[i]));                \
    }                                                                                           \
}

/* Rotate-half RoPE in place: x [tokens, heads, head_dim] with a token stride (heads
   contiguous), cos_sin [tokens, head_dim] rows of cos then sin. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                                     \
void NAME(T *x, int64_t token_stride, int64_t num_heads, int64_t head_dim,                      \
          const float *cos_sin, int64_t table_stride, int64_t num_tokens, int num_threads) {    \
    const int64_t half = head_dim / 2;                                                          \
    _Pragma("omp parallel for num_threads(num_threads) if(num_tokens * num_heads >= 256)")      \
    for (int64_t t = 0; t < num_tokens; t++) {                                                  \
        const float *cos = cos_sin + t * table_stride;                                          \
        const float *sin = cos + half;                                                          \
        for (int64_t h = 0; h < num_heads; h++) {                                               \
            T *row = x + t * token_stride + h * head_dim;                                       \
            for (int64_t i = 0; i < half; i++) {                                                \
                const float x1 = LOAD(row[i]), x2 = LOAD(row[i + half]);                        \
                const float a = x1 * cos[i], b = x2 * sin[i];                                   \
                const float c = x2 * cos[i], d = x1 * sin[i];                                   \
                row[i] = STORE(a - b);                                                          \
                row[i + half] = STORE(c + d);                                                   \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
}

DEFINE_RMS_NORM(rms_norm_f32, float, f32_load, f32_store)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ROTARY(rotary_f32, float, f32_load, f32_store)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_load, bf16_store)
