/*
 * The CPU reference's matmuls: out (N,OC) = inp (N,IC) @ W (OC,IC)^T + bias
 * and its two backward passes, in the layout train_gpt.c uses (row-major,
 * weights (out, in)).
 *
 * Two forms of each. The *_spec loops are the specification: a few lines
 * that say in which order every output element is summed. The kernels the
 * trainer runs are register-tiled for AVX2/AVX-512 and threaded, and give
 * exactly the spec's bits for any shape, tile or thread count, which is what
 * makes recomputation bitwise (docs/DESIGN.md). Needs `real` and R_FMA
 * (cpu_real.h) first. The three kernels read the calibration's clock
 * (cpu_op_clock.h) around their work.
 */
#ifndef REMAT_CPU_MATMUL_H
#define REMAT_CPU_MATMUL_H

#include <string.h>
#include "cpu_real.h"
#include "cpu_op_clock.h"

/* 32-byte vectors of real; one lane of partial sums per element. */
typedef real rvec __attribute__((vector_size(32)));
#define RLANES ((int)(32 / sizeof(real)))

static inline rvec vload(const real* p) { rvec v; memcpy(&v, p, sizeof(v)); return v; }
static inline void vstore(real* p, rvec v) { memcpy(p, &v, sizeof(v)); }
/* x - (+0) is x for every x, -0 included, so this is a plain broadcast. */
static inline rvec vsplat(real x) { return x - (rvec){0}; }
static inline real vsum(rvec v) { real s = 0; for (int k = 0; k < RLANES; k++) s += v[k]; return s; }

/* Vectors for the backward matmuls, as wide as the machine has: they sum
 * each element over n or o on its own, without lanes of partial sums, so the
 * width changes no result. */
#ifdef __AVX512F__
#define WBYTES 64
#else
#define WBYTES 32
#endif
typedef real wvec __attribute__((vector_size(WBYTES)));
#define WLANES ((int)(WBYTES / sizeof(real)))
static inline wvec wload(const real* p) { wvec v; memcpy(&v, p, sizeof(v)); return v; }
static inline void wstore(real* p, wvec v) { memcpy(p, &v, sizeof(v)); }
static inline wvec wsplat(real x) { return x - (wvec){0}; }

/* acc + a b, rounded once where the machine has FMA: the step the vector
 * tiles take (GCC contracts their acc += a * b under its default
 * -ffp-contract=fast), spelt out for the scalar tails so that an element's
 * bits do not depend on whether it falls in a tile or a tail. */
static inline real madd(real acc, real a, real b) {
#ifdef __FMA__
    return R_FMA(a, b, acc);
#else
    return acc + a * b;
#endif
}

/* ------------------------------------------------------------------------ */
/* The specification: each output element summed in plain loops, in the     */
/* order the fast kernels below must reproduce bit for bit                   */
/* (dev/test/test_matmul_order.c holds them to it).                          */

/* out (N,OC) = inp (N,IC) @ W (OC,IC)^T + bias (OC): per lane k, the
 * products a[i] w[i] for i < IC - IC % RLANES with i % RLANES == k, summed
 * from +0 in increasing i; the lanes summed from +0 in lane order; then the
 * tail i in order; then the bias. */
static inline void matmul_forward_spec(real* out, const real* inp, const real* W, const real* bias, int N, int IC, int OC) {
    int vec_end = IC - IC % RLANES;
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            const real* a = inp + (size_t)n * IC;
            const real* w = W + (size_t)o * IC;
            real lane[RLANES] = {0};
            for (int i = 0; i < vec_end; i++) lane[i % RLANES] = madd(lane[i % RLANES], a[i], w[i]);
            real s = 0;
            for (int k = 0; k < RLANES; k++) s += lane[k];
            for (int i = vec_end; i < IC; i++) s = madd(s, a[i], w[i]);
            out[(size_t)n * OC + o] = bias ? s + bias[o] : s;
        }
}

/* dinp (N,IC) = dout (N,OC) @ W (OC,IC): each element summed over o in
 * increasing order, from +0. */
static inline void matmul_backward_input_spec(real* dinp, const real* dout, const real* W, int N, int IC, int OC) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < IC; i++) {
            real acc = 0;
            for (int o = 0; o < OC; o++) acc = madd(acc, dout[(size_t)n * OC + o], W[(size_t)o * IC + i]);
            dinp[(size_t)n * IC + i] = acc;
        }
}

/* dW (OC,IC) += dout^T @ inp, dbias (OC) += column sums of dout: the
 * products over n in increasing order, added to the existing value one at a
 * time. */
static inline void matmul_backward_weight_spec(real* dW, real* dbias, const real* dout, const real* inp, int N, int IC, int OC) {
    for (int o = 0; o < OC; o++) {
        for (int i = 0; i < IC; i++) {
            real acc = dW[(size_t)o * IC + i];
            for (int n = 0; n < N; n++) acc = madd(acc, dout[(size_t)n * OC + o], inp[(size_t)n * IC + i]);
            dW[(size_t)o * IC + i] = acc;
        }
        if (dbias) {
            real acc = dbias[o];
            for (int n = 0; n < N; n++) acc += dout[(size_t)n * OC + o];
            dbias[o] = acc;
        }
    }
}

/* ------------------------------------------------------------------------ */
/* The fast kernels: register tiles, packed panels, OpenMP over blocks of    */
/* rows or columns; every element still summed in the order above.           */

/* One output element: lane-wise partial sums over IC, a fixed-order lane
 * sum, the scalar tail, then the bias. Every tile shape below produces
 * exactly these bits. */
static inline real dot_finish(rvec acc, const real* a, const real* w, int i0, int IC, const real* bias, int o) {
    real s = vsum(acc);
    for (int i = i0; i < IC; i++) s = madd(s, a[i], w[i]);
    return bias ? s + bias[o] : s;
}

/* The forward's vectors hold the RLANES lane sums of CPU_FWD_SPAN W rows side
 * by side: with AVX-512 two rows fill one 64-byte register, so the wide
 * units do the work while every lane still sums what the spec says; the
 * input row's RLANES values are repeated in each part. Without AVX-512 a
 * vector is one row's lanes. A register tile is CPU_FWD_ROWS input rows x
 * CPU_FWD_VECS vectors: 6 x 4 accumulators and their operands fit AVX-512's 32
 * registers, 4 x 2 fit the 16 of AVX2. */
#ifdef __AVX512F__
#define CPU_FWD_SPAN 2
#define CPU_FWD_ROWS 6
#define CPU_FWD_VECS 4
#else
#define CPU_FWD_SPAN 1
#define CPU_FWD_ROWS 4
#define CPU_FWD_VECS 2
#endif
#define CPU_FWD_GROUP (CPU_FWD_SPAN * CPU_FWD_VECS) /* W rows per tile */
#define CPU_FWD_OB 64                       /* W rows per block: packed once, in cache while every input row streams past */
typedef real fvec __attribute__((vector_size(32 * CPU_FWD_SPAN)));

/* fvec goes through pointers: passed by value, a 64-byte vector has another
 * ABI with AVX-512 than without, which GCC warns of. */
static inline void fload(fvec* v, const real* p) { memcpy(v, p, sizeof(*v)); }
static inline void frepeat(fvec* v, const real* p) {
    rvec h = vload(p);
#if CPU_FWD_SPAN == 1
    *v = h;
#elif defined(REMAT_FP64)
    *v = __builtin_shufflevector(h, h, 0, 1, 2, 3, 0, 1, 2, 3);
#else
    *v = __builtin_shufflevector(h, h, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
}
/* The lane sums of row `part` (< CPU_FWD_SPAN) of a vector. */
static inline rvec fpart(const fvec* v, int part) {
#if CPU_FWD_SPAN == 1
    (void)part;
    return *v;
#elif defined(REMAT_FP64)
    return part ? __builtin_shufflevector(*v, *v, 4, 5, 6, 7) : __builtin_shufflevector(*v, *v, 0, 1, 2, 3);
#else
    return part ? __builtin_shufflevector(*v, *v, 8, 9, 10, 11, 12, 13, 14, 15)
                : __builtin_shufflevector(*v, *v, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
}

/* W rows o..o+CPU_FWD_GROUP-1 packed for the tile: chunk k of every row side by
 * side, chunk after chunk, so the tile reads one stream. */
static void forward_pack_group(real* packed, const real* W, int o, int IC, int vec_end) {
    for (int k = 0; k < vec_end; k += RLANES)
        for (int c = 0; c < CPU_FWD_GROUP; c++)
            memcpy(packed + (size_t)k * CPU_FWD_GROUP + c * RLANES, W + (size_t)(o + c) * IC + k, RLANES * sizeof(real));
}

/* out rows n..n+rows-1, W rows o..o+CPU_FWD_GROUP-1 (rows <= CPU_FWD_ROWS). */
static inline __attribute__((always_inline)) void forward_tile(real* out, const real* inp, const real* W, const real* packed,
                                                                const real* bias, int n, int o, int rows, int IC, int OC,
                                                                int vec_end) {
    fvec acc[CPU_FWD_ROWS][CPU_FWD_VECS];
    memset(acc, 0, sizeof(acc));
    for (int i = 0; i < vec_end; i += RLANES) {
        const real* w = packed + (size_t)i * CPU_FWD_GROUP;
        fvec x[CPU_FWD_VECS];
        for (int c = 0; c < CPU_FWD_VECS; c++) fload(&x[c], w + c * CPU_FWD_SPAN * RLANES);
        for (int r = 0; r < rows; r++) {
            fvec a;
            frepeat(&a, inp + (size_t)(n + r) * IC + i);
            for (int c = 0; c < CPU_FWD_VECS; c++) acc[r][c] += a * x[c];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CPU_FWD_GROUP; c++) {
            int oc = o + c;
            rvec lanes = fpart(&acc[r][c / CPU_FWD_SPAN], c % CPU_FWD_SPAN);
            out[(size_t)(n + r) * OC + oc] = dot_finish(lanes, inp + (size_t)(n + r) * IC, W + (size_t)oc * IC, vec_end, IC, bias, oc);
        }
}

/* One output element the plain way: the W rows of a block past its last
 * full group. */
static inline real forward_one(const real* a, const real* w, const real* bias, int o, int IC, int vec_end) {
    rvec acc = {0};
    for (int i = 0; i < vec_end; i += RLANES) acc += vload(a + i) * vload(w + i);
    return dot_finish(acc, a, w, vec_end, IC, bias, o);
}

static void matmul_forward(real* out, const real* inp, const real* W, const real* bias, int N, int IC, int OC) {
    double t0 = cpu_op_begin();
    int vec_end = IC - IC % RLANES;
    #pragma omp parallel
    {
        real* packed = (real*)malloc_check((size_t)CPU_FWD_OB * (vec_end > 0 ? vec_end : 1) * sizeof(real), "matmul panel");
        #pragma omp for schedule(dynamic, 1)
        for (int ob = 0; ob < OC; ob += CPU_FWD_OB) {
            int oe = ob + CPU_FWD_OB < OC ? ob + CPU_FWD_OB : OC;
            int groups_end = ob + (oe - ob) / CPU_FWD_GROUP * CPU_FWD_GROUP;
            for (int o = ob; o < groups_end; o += CPU_FWD_GROUP)
                forward_pack_group(packed + (size_t)(o - ob) * vec_end, W, o, IC, vec_end);
            int n = 0;
            for (; n + CPU_FWD_ROWS <= N; n += CPU_FWD_ROWS)
                for (int o = ob; o < groups_end; o += CPU_FWD_GROUP)
                    forward_tile(out, inp, W, packed + (size_t)(o - ob) * vec_end, bias, n, o, CPU_FWD_ROWS, IC, OC, vec_end);
            for (int o = ob; o < groups_end && n < N; o += CPU_FWD_GROUP)
                forward_tile(out, inp, W, packed + (size_t)(o - ob) * vec_end, bias, n, o, N - n, IC, OC, vec_end);
            for (int m = 0; m < N; m++)
                for (int o = groups_end; o < oe; o++)
                    out[(size_t)m * OC + o] = forward_one(inp + (size_t)m * IC, W + (size_t)o * IC, bias, o, IC, vec_end);
        }
        free(packed);
    }
    cpu_op_end(OP_MATMUL_FORWARD, t0);
}

/* dinp (N,IC) = dout (N,OC) @ W (OC,IC), overwritten; each element is summed
 * over o in increasing order. A strip of 2 vectors of W columns is packed
 * contiguously a chunk of BWD_OCHUNK outputs at a time (W rows are IC apart;
 * the packed chunk stays in L1) while every register tile of 8 rows (4
 * without AVX-512) passes; a tile carries its partial sums through dinp from one chunk to the next,
 * which is exact, so the order over o is the unchunked one. */
#define BWD_OCHUNK 256

/* One register tile of ROWS rows x 2 vectors of dinp over one chunk of o: it
 * starts from +0 on the first chunk and from its stored partial sums after. */
static inline __attribute__((always_inline)) void backward_input_tile(real* d, const real* g, const real* packed, int IC, int OC,
                                                                      int len, int first, const int ROWS) {
    wvec acc[8][2];
    for (int r = 0; r < ROWS; r++) {
        acc[r][0] = first ? (wvec){0} : wload(d + (size_t)r * IC);
        acc[r][1] = first ? (wvec){0} : wload(d + (size_t)r * IC + WLANES);
    }
    for (int o = 0; o < len; o++) {
        wvec w0 = wload(packed + o * 2 * WLANES), w1 = wload(packed + o * 2 * WLANES + WLANES);
        for (int r = 0; r < ROWS; r++) {
            wvec sv = wsplat(g[(size_t)r * OC + o]);
            acc[r][0] += sv * w0;
            acc[r][1] += sv * w1;
        }
    }
    for (int r = 0; r < ROWS; r++) {
        wstore(d + (size_t)r * IC, acc[r][0]);
        wstore(d + (size_t)r * IC + WLANES, acc[r][1]);
    }
}

static void matmul_backward_input(real* dinp, const real* dout, const real* W, int N, int IC, int OC) {
    double t0 = cpu_op_begin();
    const int IB = 2 * WLANES;
    int strips = IC / IB, tile_rows = N - N % 4;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int s = 0; s < strips; s++) {
        int ib = s * IB;
        real packed[BWD_OCHUNK * 2 * WLANES];
        for (int o0 = 0; o0 < OC; o0 += BWD_OCHUNK) {
            int len = o0 + BWD_OCHUNK <= OC ? BWD_OCHUNK : OC - o0;
            for (int o = 0; o < len; o++) memcpy(packed + o * IB, W + (size_t)(o0 + o) * IC + ib, IB * sizeof(real));
            int nb = 0;
#ifdef __AVX512F__ /* 8 x 2 accumulators need its 32 vector registers */
            for (; nb + 8 <= N; nb += 8)
                backward_input_tile(dinp + (size_t)nb * IC + ib, dout + (size_t)nb * OC + o0, packed, IC, OC, len, o0 == 0, 8);
#endif
            for (; nb < tile_rows; nb += 4)
                backward_input_tile(dinp + (size_t)nb * IC + ib, dout + (size_t)nb * OC + o0, packed, IC, OC, len, o0 == 0, 4);
        }
    }
    /* the rows below the last full tile and the columns right of the last strip */
    #pragma omp parallel for schedule(dynamic, 1)
    for (int n = 0; n < N; n++)
        for (int i = n < tile_rows ? strips * IB : 0; i < IC; i++) {
            real acc = 0;
            for (int o = 0; o < OC; o++) acc = madd(acc, dout[(size_t)n * OC + o], W[(size_t)o * IC + i]);
            dinp[(size_t)n * IC + i] = acc;
        }
    cpu_op_end(OP_MATMUL_BACKWARD, t0);
}

/* dW (OC,IC) += dout^T @ inp and dbias (OC) += column sums of dout. Register
 * tiles of BWD_W_TILE rows x 2 vectors of dW; each element is summed over n in
 * order. A job is the tiles of BWD_W_ROWS rows over one strip of columns, so
 * the strip of inp (N x 2 vectors) is read from L1 by all of them, and the
 * job's columns of dout (one cache line per row) by every strip in turn. */
#define BWD_W_ROWS 16
#ifdef __AVX512F__ /* 8 x 2 accumulators need its 32 vector registers */
#define BWD_W_TILE 8
#else
#define BWD_W_TILE 4
#endif
static inline void backward_weight_tile(real* dW, const real* dout, const real* inp, int N, int IC, int OC, int ob, int ib) {
    wvec acc[BWD_W_TILE][2];
    for (int r = 0; r < BWD_W_TILE; r++) {
        acc[r][0] = wload(dW + (size_t)(ob + r) * IC + ib);
        acc[r][1] = wload(dW + (size_t)(ob + r) * IC + ib + WLANES);
    }
    for (int n = 0; n < N; n++) {
        const real* a = inp + (size_t)n * IC + ib;
        wvec a0 = wload(a), a1 = wload(a + WLANES);
        const real* d = dout + (size_t)n * OC + ob;
        for (int r = 0; r < BWD_W_TILE; r++) {
            wvec sv = wsplat(d[r]);
            acc[r][0] += sv * a0;
            acc[r][1] += sv * a1;
        }
    }
    for (int r = 0; r < BWD_W_TILE; r++) {
        wstore(dW + (size_t)(ob + r) * IC + ib, acc[r][0]);
        wstore(dW + (size_t)(ob + r) * IC + ib + WLANES, acc[r][1]);
    }
}

static void matmul_backward_weight(real* dW, real* dbias, const real* dout, const real* inp, int N, int IC, int OC) {
    double t0 = cpu_op_begin();
    const int IB = 2 * WLANES;
    int iblocks = (IC + IB - 1) / IB, oblocks = (OC + BWD_W_ROWS - 1) / BWD_W_ROWS;
    #pragma omp parallel for schedule(dynamic, 4)
    for (int job = 0; job < oblocks * iblocks; job++) {
        int ob0 = (job / iblocks) * BWD_W_ROWS, ib = (job % iblocks) * IB;
        int oe = ob0 + BWD_W_ROWS < OC ? ob0 + BWD_W_ROWS : OC;
        int width = ib + IB <= IC ? IB : IC - ib;
        for (int ob = ob0; ob < oe; ob += BWD_W_TILE) {
            int rows = ob + BWD_W_TILE <= oe ? BWD_W_TILE : oe - ob;
            if (width == IB && rows == BWD_W_TILE) {
                backward_weight_tile(dW, dout, inp, N, IC, OC, ob, ib);
                continue;
            }
            for (int r = 0; r < rows; r++)
                for (int k = 0; k < width; k++) {
                    real acc = dW[(size_t)(ob + r) * IC + ib + k];
                    for (int n = 0; n < N; n++) acc = madd(acc, dout[(size_t)n * OC + ob + r], inp[(size_t)n * IC + ib + k]);
                    dW[(size_t)(ob + r) * IC + ib + k] = acc;
                }
        }
    }
    if (dbias) {
        #pragma omp parallel for schedule(dynamic, 64)
        for (int o = 0; o < OC; o++) {
            real acc = dbias[o];
            for (int n = 0; n < N; n++) acc += dout[(size_t)n * OC + o];
            dbias[o] = acc;
        }
    }
    cpu_op_end(OP_MATMUL_BACKWARD, t0);
}

#endif
