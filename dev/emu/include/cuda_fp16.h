/*
 * cuda_fp16.h stand-in for remat's CPU emulator of CUDA (dev/emu; not a GPU).
 *
 * Why it exists: the CUDA sources include <cuda_fp16.h> for the __half storage type
 * (FP16 builds: IEEE binary16, 11 significant bits, largest finite 65504). This header gives the type with the documented rounding (see
 * emu/half_types.h), its conversions, bit casts, comparisons and the
 * arithmetic operators and intrinsics device code uses, on host and device
 * alike. Anything else from the real header is absent: using it is a
 * compile error naming it, not a guess.
 */
#ifndef REMAT_EMU_CUDA_FP16_H
#define REMAT_EMU_CUDA_FP16_H

#include "emu/half_types.h"

struct __half_raw {
    unsigned short x;
};

struct __half {
    unsigned short __x;
    __half() = default;
    constexpr __half(const __half_raw& r) : __x(r.x) {}
    __half(float f) : __x(emu::double_to_half_bits(f)) {}
    __half(double d) : __x(emu::double_to_half_bits(d)) {}
    __half(int i) : __x(emu::double_to_half_bits((double)i)) {}
    __half& operator=(float f) { __x = emu::double_to_half_bits(f); return *this; }
    __half& operator=(const __half_raw& r) { __x = r.x; return *this; }
    operator float() const { return emu::half_bits_to_float(__x); }
    operator __half_raw() const { return __half_raw{__x}; }
};

static inline float __half2float(__half h) { return emu::half_bits_to_float(h.__x); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline __half __float2half(float f) { return __half(f); }
static inline __half __double2half(double d) { return __half(d); }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline short __half_as_short(__half h) { return (short)h.__x; }
static inline __half __ushort_as_half(unsigned short u) { return __half(__half_raw{u}); }
static inline __half __short_as_half(short u) { return __half(__half_raw{(unsigned short)u}); }

/* arithmetic: in float, rounded once to nearest even */
static inline __half operator+(__half a, __half b) { return __half((float)a + (float)b); }
static inline __half operator-(__half a, __half b) { return __half((float)a - (float)b); }
static inline __half operator*(__half a, __half b) { return __half((float)a * (float)b); }
static inline __half operator/(__half a, __half b) { return __half((float)a / (float)b); }
static inline __half operator-(__half a) { return __half(__half_raw{(unsigned short)(a.__x ^ 0x8000u)}); }
static inline __half operator+(__half a) { return a; }
static inline __half& operator+=(__half& a, __half b) { return a = a + b; }
static inline __half& operator-=(__half& a, __half b) { return a = a - b; }
static inline __half& operator*=(__half& a, __half b) { return a = a * b; }
static inline __half& operator/=(__half& a, __half b) { return a = a / b; }
static inline bool operator==(__half a, __half b) { return (float)a == (float)b; }
static inline bool operator!=(__half a, __half b) { return (float)a != (float)b; }
static inline bool operator<(__half a, __half b) { return (float)a < (float)b; }
static inline bool operator>(__half a, __half b) { return (float)a > (float)b; }
static inline bool operator<=(__half a, __half b) { return (float)a <= (float)b; }
static inline bool operator>=(__half a, __half b) { return (float)a >= (float)b; }

static inline __half __hadd(__half a, __half b) { return a + b; }
static inline __half __hsub(__half a, __half b) { return a - b; }
static inline __half __hmul(__half a, __half b) { return a * b; }
static inline __half __hdiv(__half a, __half b) { return a / b; }
static inline __half __hneg(__half a) { return -a; }
static inline __half __habs(__half a) { return __half(__half_raw{(unsigned short)(a.__x & 0x7fffu)}); }
static inline bool __heq(__half a, __half b) { return a == b; }
static inline bool __hne(__half a, __half b) { return a != b; }
static inline bool __hlt(__half a, __half b) { return a < b; }
static inline bool __hgt(__half a, __half b) { return a > b; }
static inline bool __hle(__half a, __half b) { return a <= b; }
static inline bool __hge(__half a, __half b) { return a >= b; }
static inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
static inline int __hisinf(__half a) { return a.__x == 0x7c00u ? 1 : a.__x == (0x8000u | 0x7c00u) ? -1 : 0; }
/* __hmax/__hmin: the documented rule, NaN only when both are NaN */
static inline __half __hmax(__half a, __half b) { return __hisnan(a) ? b : __hisnan(b) ? a : (a > b ? a : b); }
static inline __half __hmin(__half a, __half b) { return __hisnan(a) ? b : __hisnan(b) ? a : (a < b ? a : b); }

#endif
