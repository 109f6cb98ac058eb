/* Math that vectorizes, shared by the kernels. */

#ifndef TANDEM_VECTOR_MATH_H
#define TANDEM_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>

/* 2^f for f in [-1/2, 1/2], highest power first (Cephes' exp2f coefficients); the scalar and
   vector exps share them. */
#define EXP2_DEGREE 6
static const float EXP2_POLYNOMIAL[EXP2_DEGREE + 1] = {
    1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f,
    2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f,
};

/* e^x for x <= 0 (scores minus their running max), relative error ~2e-7: 2^(x log2 e) as
   2^n (exponent bits) times a degree-6 polynomial for 2^f, f in [-1/2, 1/2] (Cephes' exp2f
   coefficients). Unlike libm's expf it vectorizes: softmax's exps cost no more than its dots. */
static inline float exp_nonpositive(float x) {
    const float y = (x < -87.0f ? -87.0f : x) * 1.44269504088896341f;
    const float n = floorf(y + 0.5f);
    const float f = y - n;
    float p = EXP2_POLYNOMIAL[0];
    for (int i = 1; i < EXP2_DEGREE + 1; i++) p = p * f + EXP2_POLYNOMIAL[i];
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* x·sigmoid(x) through e^−|x| (never overflows). */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    return x * (x >= 0.0f ? 1.0f : e) / (1.0f + e);
}

#endif
