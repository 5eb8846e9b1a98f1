/*
 * The CPU reference's number type: `real` is fp32, or fp64 in the
 * gradient-check build (-DREMAT_FP64), with the libm functions of that width.
 */
#ifndef REMAT_CPU_REAL_H
#define REMAT_CPU_REAL_H

#include <math.h>

#ifdef REMAT_FP64
typedef double real;
#define R_EXP exp
#define R_LOG log
#define R_SQRT sqrt
#define R_TANH tanh
#define R_FMA fma
#else
typedef float real;
#define R_EXP expf
#define R_LOG logf
#define R_SQRT sqrtf
#define R_TANH tanhf
#define R_FMA fmaf
#endif


#endif
