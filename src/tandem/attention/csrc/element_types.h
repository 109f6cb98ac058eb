/* Loading and storing the cache and activation element types as fp32, shared by the kernels. */

#ifndef TANDEM_ELEMENT_TYPES_H
#define TANDEM_ELEMENT_TYPES_H

#include <math.h>
#include <stdint.h>

static inline float bf16_load(uint16_t bits) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)bits << 16;
    return c.f;
}

static inline uint16_t bf16_store(float value) {
    union { uint32_t u; float f; } c;
    c.f = value;
    if (isnan(value)) return 0x7FC0;
    return (uint16_t)((c.u + 0x7FFF + ((c.u >> 16) & 1)) >> 16); /* round to nearest even */
}

/* An IEEE half's bits as fp32, by bit operations (no _Float16: GCC < 12 lacks it on x86); for
   the kernels' paths without F16C. */
static inline float f16_load(uint16_t bits) {
    const uint32_t sign = (uint32_t)(bits & 0x8000) << 16;
    const uint32_t exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF;
    union { uint32_t u; float f; } c;
    if (exponent == 0x1F) {
        c.u = sign | 0x7F800000u | (mantissa << 13); /* inf, NaN */
    } else if (exponent != 0) {
        c.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else { /* zero, subnormal: mantissa · 2^-24 */
        c.f = (float)mantissa * 5.9604644775390625e-8f;
        c.u |= sign;
    }
    return c.f;
}

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#endif
