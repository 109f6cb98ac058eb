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

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

#endif
