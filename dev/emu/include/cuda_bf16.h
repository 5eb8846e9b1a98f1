/*
 * cuda_bf16.h stand-in for remat's CPU emulator of CUDA (dev/emu; not a GPU).
 *
 * Why it exists: the CUDA sources include <cuda_bf16.h> for the __nv_bfloat16 storage type
 * (BF16 builds: 8 significant bits, float's exponent range). This header gives the type with the documented rounding (see
 * emu/half_types.h), its conversions, bit casts, comparisons and the
 * arithmetic operators and intrinsics device code uses, on host and device
 * alike. Anything else from the real header is absent: using it is a
 * compile error naming it, not a guess.
 */
#ifndef REMAT_EMU_CUDA_BF16_H
#define REMAT_EMU_CUDA_BF16_H

#include "emu/half_types.h"

struct __nv_bfloat16_raw {
    unsigned short x;
};

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
    __nv_bfloat16(float f) : __x(emu::float_to_bf16_bits(f)) {}
    __nv_bfloat16(double d) : __x(emu::double_to_bf16_bits(d)) {}
    __nv_bfloat16(int i) : __x(emu::double_to_bf16_bits((double)i)) {}
    __nv_bfloat16& operator=(float f) { __x = emu::float_to_bf16_bits(f); return *this; }
    __nv_bfloat16& operator=(const __nv_bfloat16_raw& r) { __x = r.x; return *this; }
    operator float() const { return emu::bf16_bits_to_float(__x); }
    operator __nv_bfloat16_raw() const { return __nv_bfloat16_raw{__x}; }
};

static inline float __bfloat162float(__nv_bfloat16 h) { return emu::bf16_bits_to_float(h.__x); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
static inline short __bfloat16_as_short(__nv_bfloat16 h) { return (short)h.__x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16(__nv_bfloat16_raw{u}); }
static inline __nv_bfloat16 __short_as_bfloat16(short u) { return __nv_bfloat16(__nv_bfloat16_raw{(unsigned short)u}); }

/* arithmetic: in float, rounded once to nearest even */
static inline __nv_bfloat16 operator+(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16((float)a + (float)b); }
static inline __nv_bfloat16 operator-(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16((float)a - (float)b); }
static inline __nv_bfloat16 operator*(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16((float)a * (float)b); }
static inline __nv_bfloat16 operator/(__nv_bfloat16 a, __nv_bfloat16 b) { return __nv_bfloat16((float)a / (float)b); }
static inline __nv_bfloat16 operator-(__nv_bfloat16 a) { return __nv_bfloat16(__nv_bfloat16_raw{(unsigned short)(a.__x ^ 0x8000u)}); }
static inline __nv_bfloat16 operator+(__nv_bfloat16 a) { return a; }
static inline __nv_bfloat16& operator+=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a + b; }
static inline __nv_bfloat16& operator-=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a - b; }
static inline __nv_bfloat16& operator*=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a * b; }
static inline __nv_bfloat16& operator/=(__nv_bfloat16& a, __nv_bfloat16 b) { return a = a / b; }
static inline bool operator==(__nv_bfloat16 a, __nv_bfloat16 b) { return (float)a == (float)b; }
static inline bool operator!=(__nv_bfloat16 a, __nv_bfloat16 b) { return (float)a != (float)b; }
static inline bool operator<(__nv_bfloat16 a, __nv_bfloat16 b) { return (float)a < (float)b; }
static inline bool operator>(__nv_bfloat16 a, __nv_bfloat16 b) { return (float)a > (float)b; }
static inline bool operator<=(__nv_bfloat16 a, __nv_bfloat16 b) { return (float)a <= (float)b; }
static inline bool operator>=(__nv_bfloat16 a, __nv_bfloat16 b) { return (float)a >= (float)b; }

static inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return a + b; }
static inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return a - b; }
static inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return a * b; }
static inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) { return a / b; }
static inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return -a; }
static inline __nv_bfloat16 __habs(__nv_bfloat16 a) { return __nv_bfloat16(__nv_bfloat16_raw{(unsigned short)(a.__x & 0x7fffu)}); }
static inline bool __heq(__nv_bfloat16 a, __nv_bfloat16 b) { return a == b; }
static inline bool __hne(__nv_bfloat16 a, __nv_bfloat16 b) { return a != b; }
static inline bool __hlt(__nv_bfloat16 a, __nv_bfloat16 b) { return a < b; }
static inline bool __hgt(__nv_bfloat16 a, __nv_bfloat16 b) { return a > b; }
static inline bool __hle(__nv_bfloat16 a, __nv_bfloat16 b) { return a <= b; }
static inline bool __hge(__nv_bfloat16 a, __nv_bfloat16 b) { return a >= b; }
static inline bool __hisnan(__nv_bfloat16 a) { return (a.__x & 0x7fffu) > 0x7f80u; }
static inline int __hisinf(__nv_bfloat16 a) { return a.__x == 0x7f80u ? 1 : a.__x == (0x8000u | 0x7f80u) ? -1 : 0; }
/* __hmax/__hmin: the documented rule, NaN only when both are NaN */
static inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return __hisnan(a) ? b : __hisnan(b) ? a : (a > b ? a : b); }
static inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return __hisnan(a) ? b : __hisnan(b) ? a : (a < b ? a : b); }

#endif
