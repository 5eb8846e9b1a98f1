/*
 * half_types.h: the 16-bit float types of remat's CPU emulator of CUDA
 * (dev/emu; not a GPU), behind the cuda_fp16.h and cuda_bf16.h stand-ins.
 *
 * Why it exists: the trainer stores parameters, gradients and activations in
 * __nv_bfloat16 (BF16 builds) or __half (FP16 builds), and the emulator must
 * reproduce their documented rounding bit for bit, since test_gpt compares
 * bits across recompute modes. Conversions to the 16-bit types round to
 * nearest even (overflow to +-inf, gradual underflow to subnormals and zero,
 * NaN to the canonical NaN 0x7fff); conversions to float are exact.
 * Arithmetic operators compute in float and round once: for + - * / of two
 * 16-bit values that equals the correctly rounded 16-bit result (float's 24
 * bits are at least 2p+2 for p = 11 and p = 8, so double rounding is
 * innocuous). Checked against the compiler's _Float16 by dev/emu/selftest.cu.
 */
#ifndef REMAT_EMU_HALF_TYPES_H
#define REMAT_EMU_HALF_TYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

namespace emu {

static inline uint64_t dbits(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }
static inline uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* double -> IEEE binary16, round to nearest even (every float is a double, exactly). */
static inline uint16_t double_to_half_bits(double d) {
    uint64_t u = dbits(d);
    uint16_t sign = (uint16_t)((u >> 48) & 0x8000u);
    u &= 0x7fffffffffffffffull;
    if (u > 0x7ff0000000000000ull) return 0x7fffu;                 /* NaN */
    if (u == 0x7ff0000000000000ull) return (uint16_t)(sign | 0x7c00u); /* inf */
    int exp = (int)(u >> 52);
    if (exp == 0) return sign; /* double subnormal: far below half's range */
    int e = exp - 1023;
    if (e >= 16) return (uint16_t)(sign | 0x7c00u);
    uint64_t full = (u & 0x000fffffffffffffull) | 0x0010000000000000ull; /* 53 bits */
    uint64_t h, rem, halfway;
    int shift;
    if (e >= -14) { /* normal half */
        shift = 42;
        h = ((uint64_t)(e + 15) << 10) | ((full >> shift) & 0x3ffu);
    } else { /* subnormal half: units of 2^-24 */
        shift = 28 - e;
        if (shift > 54) return sign; /* below 2^-25 */
        h = full >> shift;
    }
    rem = full & ((1ull << shift) - 1);
    halfway = 1ull << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1))) h++; /* may carry into the exponent, up to inf */
    return (uint16_t)(sign | h);
}

static inline float half_bits_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 31) return bits_f(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
    if (exp == 0) {
        float v = ldexpf((float)mant, -24);
        return sign ? -v : v;
    }
    return bits_f(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

static inline uint16_t float_to_bf16_bits(float f) {
    uint32_t u = fbits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* double -> bf16 without double rounding: to float with round-to-odd, then to nearest even. */
static inline uint16_t double_to_bf16_bits(double d) {
    float f = (float)d;
    if (d == d && (double)f != d) {
        uint32_t u = fbits(f);
        if (fabs((double)f) > fabs(d)) u -= 1;
        u |= 1u;
        f = bits_f(u);
    }
    return float_to_bf16_bits(f);
}

static inline float bf16_bits_to_float(uint16_t b) { return bits_f((uint32_t)b << 16); }

}  // namespace emu

#endif
