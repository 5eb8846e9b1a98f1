/*
 * remat CPU reference trainer: GPT-2 in plain C with OpenMP.
 *
 * Its job is to be right: every GPU gradient is checked against it. All
 * tensors are `real` (fp32; fp64 in the gradient-check build, -DREMAT_FP64),
 * row-major, and every kernel is deterministic: each output element is summed
 * in an order fixed by the code, never by the thread count, so a run gives
 * the same bits every time and a recomputed activation equals the original.
 *
 * Shapes: B batch, T time, C channels, NH heads, hs = C/NH, N = B*T rows,
 * V vocabulary, Vp padded vocabulary, L layers. Weights are (out, in).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "llmc/trainer.h"

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

/* 32-byte vectors of real; one lane of partial sums per element. */
typedef real rvec __attribute__((vector_size(32)));
#define RLANES ((int)(32 / sizeof(real)))
#define CPU_LOGITS_CHUNK_ROWS 256
#define LN_EPS 1e-5

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
/* matmul: out (N,OC) = inp (N,IC) @ W (OC,IC)^T + bias (OC)                 */

/* One output element: lane-wise partial sums over IC, a fixed-order lane
 * sum, the scalar tail, then the bias. Every tile shape below produces
 * exactly these bits. */
static inline real dot_finish(rvec acc, const real* a, const real* w, int i0, int IC, const real* bias, int o) {
    real s = vsum(acc);
    for (int i = i0; i < IC; i++) s = madd(s, a[i], w[i]);
    return bias ? s + bias[o] : s;
}

/* W rows per register tile of the forward: 4 x 4 accumulators need the 32
 * vector registers AVX-512 brings, 4 x 2 fit in 16. */
#ifdef __AVX512F__
#define FWD_WROWS 4
#else
#define FWD_WROWS 2
#endif

static void matmul_forward(real* out, const real* inp, const real* W, const real* bias, int N, int IC, int OC) {
    const int OB = 64; /* a block of W rows stays in cache while all rows stream past */
    int vec_end = IC - IC % RLANES;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int ob = 0; ob < OC; ob += OB) {
        int oe = ob + OB < OC ? ob + OB : OC;
        int n = 0;
        for (; n + 4 <= N; n += 4) {
            const real* a[4] = {inp + (size_t)n * IC, inp + (size_t)(n + 1) * IC, inp + (size_t)(n + 2) * IC, inp + (size_t)(n + 3) * IC};
            int o = ob;
            for (; o + FWD_WROWS <= oe; o += FWD_WROWS) {
                const real* w = W + (size_t)o * IC;
                rvec acc[4][FWD_WROWS];
                memset(acc, 0, sizeof(acc));
                for (int i = 0; i < vec_end; i += RLANES) {
                    rvec x[FWD_WROWS];
                    for (int c = 0; c < FWD_WROWS; c++) x[c] = vload(w + (size_t)c * IC + i);
                    for (int r = 0; r < 4; r++) {
                        rvec ar = vload(a[r] + i);
                        for (int c = 0; c < FWD_WROWS; c++) acc[r][c] += ar * x[c];
                    }
                }
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < FWD_WROWS; c++)
                        out[(size_t)(n + r) * OC + o + c] = dot_finish(acc[r][c], a[r], w + (size_t)c * IC, vec_end, IC, bias, o + c);
            }
            for (; o < oe; o++)
                for (int r = 0; r < 4; r++) {
                    const real* w = W + (size_t)o * IC;
                    rvec acc = {0};
                    for (int i = 0; i < vec_end; i += RLANES) acc += vload(a[r] + i) * vload(w + i);
                    out[(size_t)(n + r) * OC + o] = dot_finish(acc, a[r], w, vec_end, IC, bias, o);
                }
        }
        for (; n < N; n++) {
            const real* a = inp + (size_t)n * IC;
            for (int o = ob; o < oe; o++) {
                const real* w = W + (size_t)o * IC;
                rvec acc = {0};
                for (int i = 0; i < vec_end; i += RLANES) acc += vload(a + i) * vload(w + i);
                out[(size_t)n * OC + o] = dot_finish(acc, a, w, vec_end, IC, bias, o);
            }
        }
    }
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
    if (!dbias) return;
    #pragma omp parallel for schedule(dynamic, 64)
    for (int o = 0; o < OC; o++) {
        real acc = dbias[o];
        for (int n = 0; n < N; n++) acc += dout[(size_t)n * OC + o];
        dbias[o] = acc;
    }
}

/* ------------------------------------------------------------------------ */
/* encoder: x (B,T,C) = wte[tokens] + wpe[position]                         */
/* position: the token's in its sequence, or with pos_start (B,T) (packed    */
/* documents, --reset-position-ids) its distance from its document's start.  */

static inline int encoder_position(const TokenLayout* lay, const int* pos_start, size_t bt) {
    return token_position(lay, bt) - (pos_start ? pos_start[bt] : 0);
}

static void encoder_forward(real* x, const int* tokens, const real* wte, const real* wpe, int B, int C, const TokenLayout* lay,
                            const int* pos_start) {
    #pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * lay->T; bt++) {
        const real* te = wte + (size_t)tokens[bt] * C;
        const real* pe = wpe + (size_t)encoder_position(lay, pos_start, (size_t)bt) * C;
        real* dst = x + (size_t)bt * C;
        for (int c = 0; c < C; c++) dst[c] = te[c] + pe[c];
    }
}

/* dwte rows are shared by repeated tokens, so they accumulate serially in
 * row order; dwpe sums over b in order, parallel over t (each local t is its
 * own position row), or with restarting positions, whose rows documents
 * share, in row order, parallel over blocks of channels. */
static void encoder_backward(real* dwte, real* dwpe, const real* dx, const int* tokens, int B, int C, const TokenLayout* lay,
                             const int* pos_start) {
    int T = lay->T;
    for (int bt = 0; bt < B * T; bt++) {
        real* dst = dwte + (size_t)tokens[bt] * C;
        const real* src = dx + (size_t)bt * C;
        for (int c = 0; c < C; c++) dst[c] += src[c];
    }
    if (pos_start) {
        const int CB = 16; /* a cache line of fp32 per row */
        #pragma omp parallel for schedule(static)
        for (int c0 = 0; c0 < C; c0 += CB)
            for (int bt = 0; bt < B * T; bt++) {
                real* dpe = dwpe + (size_t)encoder_position(lay, pos_start, (size_t)bt) * C;
                const real* src = dx + (size_t)bt * C;
                for (int c = c0; c < C && c < c0 + CB; c++) dpe[c] += src[c];
            }
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        real* dpe = dwpe + (size_t)token_position(lay, (size_t)t) * C;
        for (int b = 0; b < B; b++) {
            const real* src = dx + ((size_t)b * T + t) * C;
            for (int c = 0; c < C; c++) dpe[c] += src[c];
        }
    }
}

/* ------------------------------------------------------------------------ */
/* layernorm over C: out (N,C) = (x - mean) * rstd * w + b; mean, rstd (N)   */

/* The normalisation itself, used by the forward pass and by recomputation
 * from stored statistics alike, so both give the same bits. */
static __attribute__((noinline)) void layernorm_apply(real* out, const real* x, const real* mean, const real* rstd,
                                                      const real* w, const real* b, int N, int C) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real* xr = x + (size_t)n * C;
        real* o = out + (size_t)n * C;
        real m = mean[n], s = rstd[n];
        for (int c = 0; c < C; c++) o[c] = (xr[c] - m) * s * w[c] + b[c];
    }
}

static void layernorm_forward(real* out, real* mean, real* rstd, const real* x, const real* w, const real* b, int N, int C) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real* xr = x + (size_t)n * C;
        real m = 0, v = 0;
        for (int c = 0; c < C; c++) m += xr[c];
        m /= (real)C;
        for (int c = 0; c < C; c++) v += (xr[c] - m) * (xr[c] - m);
        v /= (real)C;
        mean[n] = m;
        rstd[n] = (real)1 / R_SQRT(v + (real)LN_EPS);
    }
    layernorm_apply(out, x, mean, rstd, w, b, N, C);
}

/* dx (N,C) += input gradient; dw, db (C) += parameter gradients. */
static void layernorm_backward(real* dx, real* dw, real* db, const real* dout, const real* x, const real* w,
                               const real* mean, const real* rstd, int N, int C) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real* xr = x + (size_t)n * C;
        const real* d = dout + (size_t)n * C;
        real m = mean[n], s = rstd[n], dmean = 0, dnorm_norm = 0;
        for (int c = 0; c < C; c++) {
            real dnorm = d[c] * w[c];
            dmean += dnorm;
            dnorm_norm += dnorm * (xr[c] - m) * s;
        }
        dmean /= (real)C;
        dnorm_norm /= (real)C;
        real* dxr = dx + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            real norm = (xr[c] - m) * s;
            dxr[c] += s * (d[c] * w[c] - dmean - norm * dnorm_norm);
        }
    }
    #pragma omp parallel for schedule(static)
    for (int c = 0; c < C; c++) {
        real gw = dw[c], gb = db[c];
        for (int n = 0; n < N; n++) {
            real dv = dout[(size_t)n * C + c];
            gw = madd(gw, dv * (x[(size_t)n * C + c] - mean[n]), rstd[n]);
            gb += dv;
        }
        dw[c] = gw;
        db[c] = gb;
    }
}

/* ------------------------------------------------------------------------ */
/* attention: qkv (B,T,3C) = [q | k | v] with head h at channels h*hs;        */
/* out (B,T,C); lse (B,NH,T) = log-sum-exp of each row's scaled scores.       */
/* No (T,T) matrix: forward uses an online softmax, backward recomputes the   */
/* probabilities from lse, one score at a time. With dropout (drop not NULL,  */
/* threshold > 0) out = (mask * P / keep) V; lse stays that of P, and since   */
/* dO.out = sum of dP' P' over the dropped P', the backward's row term does    */
/* not change: dS = P (mask dP' / keep - dO.out).                             */

/* The dropout factor of probability (t, u) of head bh: 0 or 1/keep. */
static inline real attention_dropout_factor(const DropoutSite* drop, int bh, int T, int t, int u) {
    if (!drop || !drop->threshold) return 1;
    return dropout_keep_attention(drop, bh, T, t, u) ? (real)drop->scale : 0;
}

/* Merges one block's normalised output `part` (hs) and log-sum-exp `l` into
 * the running o (hs) and *lse: both are softmax-weighted means over disjoint
 * key sets, so the union's is their mean weighted by exp(lse - new lse). */
static inline void attention_merge(real* o, real* lse, const real* part, real l, int hs) {
    real m = *lse > l ? *lse : l;
    real merged = m + R_LOG(R_EXP(*lse - m) + R_EXP(l - m));
    real w0 = R_EXP(*lse - merged), w1 = R_EXP(l - merged);
    for (int i = 0; i < hs; i++) o[i] = o[i] * w0 + part[i] * w1;
    *lse = merged;
}

/* out (B,Tl,C), lse (B,NH,Tl): the block's rows written (first) or merged
 * into (a later block of the same queries). q from qkv (B,Tl,3C); keys from
 * kv, a (B,Tl,ld) tensor whose rows hold K at channel 0 and V at C. */
static void attention_block_forward(real* out, real* lse, const real* qkv, const real* kv, int ld, const AttentionBlock* a,
                                    int first, const DropoutSite* drop) {
    int C = a->C, NH = a->NH, hs = C / NH, Tl = a->Tl;
    real scale = (real)1 / R_SQRT((real)hs);
    #pragma omp parallel
    {
        real* part = first ? NULL : (real*)malloc_check((size_t)hs * sizeof(real), "attention block");
        #pragma omp for schedule(static)
        for (int bh = 0; bh < a->B * NH; bh++) {
            int b = bh / NH, h = bh % NH;
            for (int i = 0; i < a->Tq; i++) {
                int seen = block_keys_seen(a, i), from = block_keys_first(a, b, i), t = a->q0 + i;
                size_t row = (size_t)b * Tl + a->qi + i;
                if (seen == 0) continue; /* the causal mask empties the row here: the block leaves it alone */
                if (from >= seen) { /* documents: no key here; a query's first block then holds nothing (lse -inf) for later ones to merge into */
                    if (!first) continue;
                    for (int d = 0; d < hs; d++) out[row * C + h * hs + d] = 0;
                    lse[((size_t)b * NH + h) * Tl + a->qi + i] = -INFINITY;
                    continue;
                }
                const real* q = qkv + row * 3 * C + h * hs;
                real* o = first ? out + row * C + h * hs : part;
                real run_max = -INFINITY, run_sum = 0;
                for (int d = 0; d < hs; d++) o[d] = 0;
                for (int j = from; j < seen; j++) {
                    const real* k = kv + ((size_t)b * Tl + a->ki + j) * ld + h * hs;
                    const real* v = k + C;
                    real sc = 0;
                    for (int d = 0; d < hs; d++) sc += q[d] * k[d];
                    sc *= scale;
                    if (sc > run_max) { /* rescale what was summed against the old maximum */
                        real corr = R_EXP(run_max - sc);
                        run_sum *= corr;
                        for (int d = 0; d < hs; d++) o[d] *= corr;
                        run_max = sc;
                    }
                    real p = R_EXP(sc - run_max), pv = p * attention_dropout_factor(drop, bh, a->T, t, a->k0 + j);
                    run_sum += p;
                    for (int d = 0; d < hs; d++) o[d] += pv * v[d];
                }
                for (int d = 0; d < hs; d++) o[d] /= run_sum;
                real* l = lse + ((size_t)b * NH + h) * Tl + a->qi + i;
                if (first) *l = run_max + R_LOG(run_sum);
                else attention_merge(out + row * C + h * hs, l, part, run_max + R_LOG(run_sum), hs);
            }
        }
        free(part);
    }
}

/* The block's share of the backward: dq (in dqkv (B,Tl,3C)) and dk, dv (in
 * dkv, (B,Tl,ld) with dK at 0 and dV at C) accumulate; out and lse are the
 * merged ones of all blocks. Each (b,h) job owns its head's slices, so
 * parallel jobs never write the same element. */
static void attention_block_backward(real* dqkv, real* dkv, int dld, const real* dout, const real* qkv, const real* kv, int ld,
                                     const real* out, const real* lse, const AttentionBlock* a, const DropoutSite* drop) {
    int C = a->C, NH = a->NH, hs = C / NH, Tl = a->Tl;
    real scale = (real)1 / R_SQRT((real)hs);
    #pragma omp parallel for schedule(static)
    for (int bh = 0; bh < a->B * NH; bh++) {
        int b = bh / NH, h = bh % NH;
        for (int i = 0; i < a->Tq; i++) {
            int seen = block_keys_seen(a, i), from = block_keys_first(a, b, i), t = a->q0 + i;
            size_t row = (size_t)b * Tl + a->qi + i;
            const real* q = qkv + row * 3 * C + h * hs;
            const real* o = out + row * C + h * hs;
            const real* dO = dout + row * C + h * hs;
            real* dq = dqkv + row * 3 * C + h * hs;
            real row_lse = lse[((size_t)b * NH + h) * Tl + a->qi + i], d_dot_o = 0;
            for (int d = 0; d < hs; d++) d_dot_o += dO[d] * o[d];
            for (int j = from; j < seen; j++) {
                size_t row2 = (size_t)b * Tl + a->ki + j;
                const real* k = kv + row2 * ld + h * hs;
                const real* v = k + C;
                real* dk = dkv + row2 * dld + h * hs;
                real* dv = dk + C;
                real sc = 0, dp = 0;
                for (int d = 0; d < hs; d++) { sc += q[d] * k[d]; dp += dO[d] * v[d]; }
                real p = R_EXP(sc * scale - row_lse), factor = attention_dropout_factor(drop, bh, a->T, t, a->k0 + j);
                real ds = p * (factor * dp - d_dot_o) * scale;
                for (int d = 0; d < hs; d++) {
                    dv[d] += p * factor * dO[d];
                    dq[d] += ds * k[d];
                    dk[d] += ds * q[d];
                }
            }
        }
    }
}

/* doc_start (B,T): each query's document start (NULL: no document mask). */
static void attention_forward(real* out, real* lse, const real* qkv, int B, int T, int C, int NH, const int* doc_start,
                              const DropoutSite* drop) {
    AttentionBlock a = whole_sequence(B, T, C, NH);
    a.doc_start = doc_start;
    attention_block_forward(out, lse, qkv, qkv + C, 3 * C, &a, 1, drop);
}

/* dqkv (B,T,3C) is overwritten. */
static void attention_backward(real* dqkv, const real* dout, const real* qkv, const real* out, const real* lse,
                               int B, int T, int C, int NH, const int* doc_start, const DropoutSite* drop) {
    AttentionBlock a = whole_sequence(B, T, C, NH);
    a.doc_start = doc_start;
    memset(dqkv, 0, (size_t)B * T * 3 * C * sizeof(real));
    attention_block_backward(dqkv, dqkv + C, 3 * C, dout, qkv, qkv + C, 3 * C, out, lse, &a, drop);
}

/* ------------------------------------------------------------------------ */
/* GELU, tanh approximation, elementwise over n values                       */

#define GELU_K 0.7978845608028654 /* sqrt(2/pi) */

static __attribute__((noinline)) void gelu_forward(real* out, const real* x, size_t n) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real v = x[i];
        out[i] = (real)0.5 * v * ((real)1 + R_TANH((real)GELU_K * (v + (real)0.044715 * v * v * v)));
    }
}

/* d (n) holds the output gradient on entry and the input gradient on exit. */
static void gelu_backward(real* d, const real* x, size_t n) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real v = x[i];
        real th = R_TANH((real)GELU_K * (v + (real)0.044715 * v * v * v));
        real dudx = (real)GELU_K * ((real)1 + (real)3 * (real)0.044715 * v * v);
        d[i] *= (real)0.5 * ((real)1 + th) + (real)0.5 * v * ((real)1 - th * th) * dudx;
    }
}

/* ------------------------------------------------------------------------ */
/* dropout at the embedding and residual sites, elementwise over n values of */
/* a (B,T,C) tensor (llmc/dropout.h: one generator call per 8 elements)       */

/* Element e's factor at site s given its call's words: 1/keep or 0. A select,
 * not a product with 0, so a dropped inf stays out of the sum. */
static inline real dropout_value(const DropoutSite* s, const uint32_t* words, size_t e, real v) {
    return dropout_keeps(s, words, (int)(e & 7)) ? v * (real)s->scale : 0;
}

/* The mask of site s on `rows` token rows of C from local row r0 (a token
 * tile's, or all of them): element c of local row r is element
 * token_global_row(r) * C + c of the whole batch, so a rank holding some of
 * a sequence's tokens (context parallelism) draws the bits one process
 * holding all of them draws. Whole sequences (parts 1) number elements
 * contiguously from e0 = r0 C: one generator call per 8 elements. BODY
 * handles local element i (from the first row given), global element e,
 * with the call's words w. */
#define DROPOUT_ROWS_FOR_EACH(s, r0, rows, C, lay, BODY)                                              \
    do {                                                                                               \
        if ((lay)->parts == 1) {                                                                       \
            size_t e0_ = (r0) * (size_t)(C), n_ = (rows) * (size_t)(C);                                \
            _Pragma("omp parallel for schedule(static)")                                               \
            for (size_t g = e0_ / 8; g < (e0_ + n_ + 7) / 8; g++) {                                    \
                uint32_t w[4];                                                                         \
                dropout_draws((s), g, w);                                                              \
                size_t lo = g * 8 > e0_ ? g * 8 : e0_, hi = g * 8 + 8 < e0_ + n_ ? g * 8 + 8 : e0_ + n_; \
                for (size_t e = lo; e < hi; e++) { size_t i = e - e0_; BODY; }                         \
            }                                                                                          \
        } else {                                                                                       \
            _Pragma("omp parallel for schedule(static)")                                               \
            for (size_t r = 0; r < (rows); r++) {                                                      \
                size_t ge0 = token_global_row((lay), (r0) + r) * (size_t)(C);                          \
                uint32_t w[4];                                                                         \
                for (int c = 0; c < (C); c++) {                                                        \
                    size_t e = ge0 + (size_t)c, i = r * (size_t)(C) + (size_t)c;                       \
                    if (c == 0 || (e & 7) == 0) dropout_draws((s), e >> 3, w);                         \
                    BODY;                                                                              \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    } while (0)

/* dst = src with site s's mask and scale (in place when dst == src), rows
 * [r0, r0+rows) of C (dst and src point at the first of them). */
static void dropout_mask(real* dst, const real* src, size_t r0, size_t rows, int C, const TokenLayout* lay, const DropoutSite* s) {
    DROPOUT_ROWS_FOR_EACH(s, r0, rows, C, lay, dst[i] = dropout_value(s, w, e, src[i]));
}

/* out = branch + res, the branch dropped at site s first (out may be branch),
 * rows [r0, r0+rows) of C as in dropout_mask: a residual add; without
 * dropout the plain sum, so results are bitwise those of a model that has no
 * dropout. */
static void residual_add(real* out, const real* branch, const real* res, size_t r0, size_t rows, int C, const TokenLayout* lay,
                         const DropoutSite* s) {
    size_t n = rows * (size_t)C;
    if (!s->threshold) {
        for (size_t i = 0; i < n; i++) out[i] = branch[i] + res[i];
        return;
    }
    DROPOUT_ROWS_FOR_EACH(s, r0, rows, C, lay, out[i] = dropout_value(s, w, e, branch[i]) + res[i]);
}

/* ------------------------------------------------------------------------ */
/* the model                                                                  */

typedef PARAM_TENSORS(real) ParamTensors;
typedef BLOCK_TENSORS(real) BlockTensors;

/* REMAT_PROFILE=N with REMAT_PROFILE_COST_MODEL=FILE: during step N every
 * offload copy is timed, after it the ring's messages (cpu_time_ring), and
 * the links measured from them (cost_model_add_links) go into FILE with the
 * rest of the cost model the run planned with (the CPU trainer does not
 * profile its compute). */
typedef struct {
    int step, active;
    const char* path;
    LinkTimes host, ring;
} CpuLinkProfile;

typedef struct {
    ModelConfig cfg;
    const MemoryPlan* plan;
    char* arena;
    char* host_pool;             /* offloaded checkpoints (plan.h): a second allocation, standing in for pinned memory */
    real* params;
    real* grads;
    float* adam_m;
    float* adam_v;
    ParamTensors p;              /* the parameters by name, views into params */
    ParamTensors g;              /* their gradients, views into grads */
    size_t layer_stride[NUM_PARAM_TENSORS]; /* elements per layer of a stacked tensor */
    int* inputs;                 /* (B, T) the data loader's token buffers (Backend.inputs) */
    int* targets;
    real* losses;                /* (N) per-token loss */
    real* final_res;             /* (N,C) output of the last block */
    real* lnf;                   /* (N,C) */
    real* lnf_mean;
    real* lnf_rstd;
    real* logits;                /* (chunk rows, Vp) */
    int logits_rows;
    real* grad_act[NUM_GRAD_ACTS];
    int tile_rows;               /* token tiles: rows per tile (0: untiled, one tile of B*T rows) */
    real* tile_datty;            /* token tiles: (N,C) gradient of attention's output, (N,3C) of qkv */
    real* tile_dqkv;
    int B, T;                    /* shape of the current call; at most the plan's */
    int rank, world, zero;       /* data parallelism; zero: optimizer state sharded */
    ContextGroups cp;            /* context parallelism: this rank's place in its group (degree 1: off) */
    TokenLayout layout;          /* where the current call's token rows sit in their sequences */
    real* ring_kv[2];            /* (B,T,2C) K/V blocks of the ring: the one computed on, the one arriving */
    real* ring_dkv[2];           /* (B,T,2C) their dK/dV sums, travelling back to the block's owner */
#ifdef USE_MPI
    RingTransfer ring;
#endif
    size_t shard_start, shard_count; /* parameters this rank updates */
    CpuLinkProfile links;        /* REMAT_PROFILE_COST_MODEL: the step whose transfers are timed */
    DropoutState train_dropout;  /* set_dropout's: what forward_backward drops */
    const DropoutState* drop;    /* the running pass's: &train_dropout, or &dropout_off */
    DocumentOptions docs;        /* packed documents (llmc/documents.h; eot_token -1: off) */
    int* doc_start;              /* (B,T) document starts of the current call's rows (Backend.doc_start) */
} CpuModel;

/* The document starts attention masks with, and those positions restart at
 * (NULL: none). */
static inline const int* attention_doc_start(const CpuModel* m) { return m->docs.reset_attention_mask ? m->doc_start : NULL; }
static inline const int* position_doc_start(const CpuModel* m) { return m->docs.reset_position_ids ? m->doc_start : NULL; }

/* Site `kind` of layer l in the running pass (threshold 0: no dropout). */
static inline DropoutSite cpu_site(const CpuModel* m, DropoutSiteKind kind, int l) { return dropout_site(m->drop, kind, l); }

static inline real* act(const CpuModel* m, int layer, int a) {
    return (real*)(m->arena + m->plan->layer_act[layer][a]);
}

/* Layer l's parameters, and their gradients, by name. */
static inline BlockTensors layer_params(const CpuModel* m, int l) {
    BlockTensors w;
    BLOCK_TENSORS_OF_LAYER(w, m->p, m->layer_stride, l);
    return w;
}

static inline BlockTensors layer_grads(const CpuModel* m, int l) {
    BlockTensors dw;
    BLOCK_TENSORS_OF_LAYER(dw, m->g, m->layer_stride, l);
    return dw;
}

/* The shape of the next pass: B rows of T tokens on this rank (under
 * context parallelism its chunks of sequences N T long). */
static void cpu_set_shape(CpuModel* m, int B, int T) {
    m->B = B;
    m->T = T;
    TokenLayout lay = {T, m->cp.member, m->cp.degree};
    m->layout = lay;
}

static void cpu_model_create(CpuModel* m, const MemoryPlan* plan) {
    memset(m, 0, sizeof(*m));
    m->cfg = plan->spec.cfg;
    m->plan = plan;
    m->drop = &dropout_off;
    m->docs.eot_token = -1;
    if (posix_memalign((void**)&m->arena, PLAN_ALIGN, plan->total_bytes) != 0) {
        plan_oom_report(plan, available_host_memory(), "host");
        fail("out of host memory: the plan needs %.1f MiB", mib(plan->total_bytes));
    }
    if (plan->host_total_bytes && posix_memalign((void**)&m->host_pool, PLAN_ALIGN, plan->host_total_bytes) != 0)
        fail("out of host memory: offloaded checkpoints need %.1f MiB", mib(plan->host_total_bytes));
    TRAINER_CARVE_ARENA(m, plan, real, real);
    m->tile_rows = (int)plan_tile_rows(&plan->spec);
    if (m->tile_rows) {
        m->tile_datty = (real*)(m->arena + plan->off_tile_datty);
        m->tile_dqkv = (real*)(m->arena + plan->off_tile_dqkv);
    }
    memset(m->grads, 0, plan->num_params * sizeof(real));
    memset(m->adam_m, 0, plan->shard_params * sizeof(float));
    memset(m->adam_v, 0, plan->shard_params * sizeof(float));
    m->rank = remat_proc.rank;
    m->world = plan->spec.world_size;
    m->cp = context_groups(plan_context_parallel(&plan->spec), m->rank, m->world);
    if (m->cp.degree > 1) {
        size_t block = plan_ring_kv_bytes(&plan->spec) / sizeof(real);
        m->ring_kv[0] = (real*)(m->arena + plan->off_ring_kv);
        m->ring_kv[1] = m->ring_kv[0] + block;
        m->ring_dkv[0] = (real*)(m->arena + plan->off_ring_dkv);
        m->ring_dkv[1] = m->ring_dkv[0] + block;
    }
    cpu_set_shape(m, m->B, m->T);
    m->doc_start = (int*)malloc_check((size_t)m->B * m->T * sizeof(int), "document starts");
    m->zero = plan->spec.zero_stage == 1 && m->world > 1;
    if (m->zero) shard_range(plan->num_params, m->world, m->rank, &m->shard_start, &m->shard_count);
    else { m->shard_start = 0; m->shard_count = plan->num_params; }
}

/* ------------------------------------------------------------------------ */
/* attention as a ring (context parallelism, llmc/multiproc.h)               */
/* Member r of a group of N holds chunks r and 2N-1-r (Tc = T/2 tokens each  */
/* of its T per row). At ring step s it computes its queries against the K/V */
/* block of member r - s while sending that block on to r + 1 and receiving  */
/* the next from r - 1 (two buffers); chunk pairs the causal mask empties    */
/* are skipped. Each query chunk's first block is written and later ones are */
/* merged by log-sum-exp in step order, then chunk order: a fixed order, so  */
/* the result does not depend on when messages arrive. Backward passes the   */
/* K/V blocks round again with their dK/dV sums, which each member adds to   */
/* and passes on after its block's work; after N steps they are back with    */
/* their owner. dQ stays local; the forward's lse is reused.                 */

enum { RING_TAG_KV = 1, RING_TAG_DKV = 2 };

#ifdef USE_MPI
/* Member r's K/V (B,T,2C), packed from its qkv (B,T,3C) for sending. */
static void ring_pack_kv(real* kv, const real* qkv, size_t rows, int C) {
    #pragma omp parallel for schedule(static)
    for (size_t n = 0; n < rows; n++) memcpy(kv + n * 2 * C, qkv + n * 3 * C + C, 2 * (size_t)C * sizeof(real));
}

/* The chunk pair (query chunk qc, key chunk kc of the block that started at
 * member `origin`) as an attention block; 0 when the causal mask empties it. */
static int ring_block(const CpuModel* m, int origin, int qc, int kc, AttentionBlock* a) {
    if (!context_chunk_block(m->B, m->cfg.channels, m->cfg.num_heads, m->T, m->cp.degree, m->cp.member, origin, qc, kc, a)) return 0;
    a->doc_start = attention_doc_start(m);
    return 1;
}

/* The ring's link timed on its own buffers after the profiled step: K/V
 * blocks of the run's size and of a sixteenth of it (for the latency), three
 * times each, every one after a one-byte exchange that lines the
 * neighbours up. The step's own waits are not timed: they hold whatever the
 * neighbour's attention was late, which on a loaded machine is most of them. */
static void cpu_time_ring(CpuModel* m) {
    size_t kv = plan_ring_kv_bytes(&m->plan->spec);
    for (int i = 0; i < 6; i++) {
        size_t bytes = i % 2 ? kv : (kv + 15) / 16;
        ring_post(&m->ring, &m->cp, m->ring_kv[0], m->ring_kv[1], 1, RING_TAG_KV);
        ring_wait(&m->ring, &m->cp, "the ring's link timing");
        double t0 = now_ms();
        ring_post(&m->ring, &m->cp, m->ring_kv[0], m->ring_kv[1], bytes, RING_TAG_KV);
        ring_wait(&m->ring, &m->cp, "the ring's link timing");
        link_times_add(&m->links.ring, (double)bytes, 1e-3 * (now_ms() - t0));
    }
}

static void ring_attention_forward(CpuModel* m, real* out, real* lse, const real* qkv, const DropoutSite* drop) {
    int N = m->cp.degree, C = m->cfg.channels;
    size_t rows = (size_t)m->B * m->T, bytes = rows * 2 * C * sizeof(real);
    ring_pack_kv(m->ring_kv[0], qkv, rows, C);
    for (int s = 0; s < N; s++) {
        real* cur = m->ring_kv[s % 2];
        if (s + 1 < N) ring_post(&m->ring, &m->cp, cur, m->ring_kv[(s + 1) % 2], bytes, RING_TAG_KV);
        int origin = (m->cp.member - s + N) % N;
        for (int qc = 0; qc < 2; qc++)
            for (int kc = 0; kc < 2; kc++) {
                AttentionBlock a;
                /* with documents a block no query shares one with is skipped, but a
                 * query chunk's first block is written even when it sees nothing */
                if (ring_block(m, origin, qc, kc, &a) && ((s == 0 && kc == 0) || block_has_pairs(&a)))
                    attention_block_forward(out, lse, qkv, cur, 2 * C, &a, s == 0 && kc == 0, drop);
            }
        ring_wait(&m->ring, &m->cp, "the ring attention forward");
    }
}

/* dqkv (B,T,3C) is overwritten. */
static void ring_attention_backward(CpuModel* m, real* dqkv, const real* dout, const real* qkv, const real* out, const real* lse,
                                    const DropoutSite* drop) {
    int N = m->cp.degree, C = m->cfg.channels;
    size_t rows = (size_t)m->B * m->T, bytes = rows * 2 * C * sizeof(real);
    memset(dqkv, 0, rows * 3 * C * sizeof(real));
    ring_pack_kv(m->ring_kv[0], qkv, rows, C);
    memset(m->ring_dkv[0], 0, bytes);
    for (int s = 0; s < N; s++) {
        real* cur = m->ring_kv[s % 2];
        real* dcur = m->ring_dkv[s % 2];
        if (s + 1 < N) ring_post(&m->ring, &m->cp, cur, m->ring_kv[(s + 1) % 2], bytes, RING_TAG_KV);
        int origin = (m->cp.member - s + N) % N;
        for (int qc = 0; qc < 2; qc++)
            for (int kc = 0; kc < 2; kc++) {
                AttentionBlock a;
                if (ring_block(m, origin, qc, kc, &a) && block_has_pairs(&a)) attention_block_backward(dqkv, dcur, 2 * C, dout, qkv, cur, 2 * C, out, lse, &a, drop);
            }
        /* the sums go on to the next member; the last step's reach their owner */
        ring_post(&m->ring, &m->cp, dcur, m->ring_dkv[(s + 1) % 2], bytes, RING_TAG_DKV);
        ring_wait(&m->ring, &m->cp, "the ring attention backward");
    }
    const real* own = m->ring_dkv[N % 2];
    #pragma omp parallel for schedule(static)
    for (size_t n = 0; n < rows; n++)
        for (int c = 0; c < 2 * C; c++) dqkv[n * 3 * C + C + c] = own[n * 2 * C + c];
}
#else
static void ring_attention_forward(CpuModel* m, real* out, real* lse, const real* qkv, const DropoutSite* drop) {
    (void)m; (void)out; (void)lse; (void)qkv; (void)drop;
    fail("internal: context parallelism needs MPI (this build has none)");
}
static void ring_attention_backward(CpuModel* m, real* dqkv, const real* dout, const real* qkv, const real* out, const real* lse,
                                    const DropoutSite* drop) {
    (void)m; (void)dqkv; (void)dout; (void)qkv; (void)out; (void)lse; (void)drop;
    fail("internal: context parallelism needs MPI (this build has none)");
}
#endif

/* Attention of layer l on this rank's tokens: the whole sequence here, or the ring. */
static void layer_attention_forward(CpuModel* m, int l, const DropoutSite* drop) {
    real *out = act(m, l, ACT_ATTY), *lse = act(m, l, ACT_ATT_LSE), *qkv = act(m, l, ACT_QKV);
    if (m->cp.degree > 1) ring_attention_forward(m, out, lse, qkv, drop);
    else attention_forward(out, lse, qkv, m->B, m->T, m->cfg.channels, m->cfg.num_heads, attention_doc_start(m), drop);
}

static void layer_attention_backward(CpuModel* m, int l, real* dqkv, const real* datty, const DropoutSite* drop) {
    const real *qkv = act(m, l, ACT_QKV), *out = act(m, l, ACT_ATTY), *lse = act(m, l, ACT_ATT_LSE);
    if (m->cp.degree > 1) ring_attention_backward(m, dqkv, datty, qkv, out, lse, drop);
    else attention_backward(dqkv, datty, qkv, out, lse, m->B, m->T, m->cfg.channels, m->cfg.num_heads, attention_doc_start(m), drop);
}

/* Rows [r0, ...) of layer l's activation a (plan_act_row_offset: a tiled
 * tensor the layer does not keep holds the current tile from its start). */
static inline real* act_rows(const CpuModel* m, int l, int a, int r0) { return act(m, l, a) + plan_act_row_offset(m->plan, l, a, r0); }

/* The tiles of the current call: rows per tile, all B*T rows untiled. */
static inline int tile_rows(const CpuModel* m) { return token_tile_rows((size_t)m->tile_rows, m->B * m->T); }
#define FOR_TILES(m, r0, n) FOR_TOKEN_TILES(r0, n, (m)->B * (m)->T, tile_rows(m))

/* Block l up to attention, rows [r0, r0+n): LN1 and the QKV matmul, from its stored input x. */
static void block_forward_qkv(CpuModel* m, int l, int r0, int n) {
    int C = m->cfg.channels;
    BlockTensors w = layer_params(m, l);
    real* ln1 = act_rows(m, l, ACT_LN1, r0);
    layernorm_forward(ln1, act_rows(m, l, ACT_LN1_MEAN, r0), act_rows(m, l, ACT_LN1_RSTD, r0), act_rows(m, l, ACT_X, r0), w.ln1w,
                      w.ln1b, n, C);
    matmul_forward(act_rows(m, l, ACT_QKV, r0), ln1, w.qkvw, w.qkvb, n, C, 3 * C);
}

/* Block l after attention, rows [r0, r0+n), from x and the attention
 * output: projection, residual, LN2, FC and GELU; `out` (the next layer's x,
 * all rows) receives the block output, or with out == NULL it stops after
 * the GELU: that is the recomputation for backward, which needs nothing
 * later than that. Each branch is dropped before its residual add (GPT-2's
 * resid_pdrop). */
static void block_forward_mlp(CpuModel* m, int l, int r0, int n, real* out) {
    int C = m->cfg.channels;
    size_t e0 = (size_t)r0 * C;
    BlockTensors w = layer_params(m, l);
    real* x = act_rows(m, l, ACT_X, r0);
    real* res2 = act_rows(m, l, ACT_RES2, r0);
    real* ln2 = act_rows(m, l, ACT_LN2, r0);
    real* fch = act_rows(m, l, ACT_FCH, r0);
    real* fch_gelu = act_rows(m, l, ACT_FCH_GELU, r0);
    DropoutSite resid_attn = cpu_site(m, DROPOUT_RESID_ATTN, l), resid_mlp = cpu_site(m, DROPOUT_RESID_MLP, l);
    matmul_forward(res2, act_rows(m, l, ACT_ATTY, r0), w.attprojw, w.attprojb, n, C, C);
    residual_add(res2, res2, x, (size_t)r0, (size_t)n, C, &m->layout, &resid_attn);
    layernorm_forward(ln2, act_rows(m, l, ACT_LN2_MEAN, r0), act_rows(m, l, ACT_LN2_RSTD, r0), res2, w.ln2w, w.ln2b, n, C);
    matmul_forward(fch, ln2, w.fcw, w.fcb, n, C, 4 * C);
    gelu_forward(fch_gelu, fch, (size_t)n * 4 * C);
    if (!out) return;
    matmul_forward(out + e0, fch_gelu, w.fcprojw, w.fcprojb, n, 4 * C, C);
    residual_add(out + e0, out + e0, res2, (size_t)r0, (size_t)n, C, &m->layout, &resid_mlp);
}

static void block_attention_forward(CpuModel* m, int l) {
    DropoutSite att = cpu_site(m, DROPOUT_ATTENTION, l);
    layer_attention_forward(m, l, &att);
}

/* Block l forward from its stored input x, tile by tile but for attention. */
static void block_forward(CpuModel* m, int l, real* out) {
    FOR_TILES(m, r0, n) block_forward_qkv(m, l, r0, n);
    block_attention_forward(m, l);
    FOR_TILES(m, r0, n) block_forward_mlp(m, l, r0, n, out);
}

/* The gradient a dropped residual branch receives, rows [r0, r0+n): dres
 * itself without dropout, else dres masked and scaled into dln, which is
 * free then. */
static const real* branch_grad(CpuModel* m, const DropoutSite* s, int r0, int n) {
    size_t e0 = (size_t)r0 * m->cfg.channels;
    real* dres = m->grad_act[GRAD_DRES] + e0;
    if (!s->threshold) return dres;
    dropout_mask(m->grad_act[GRAD_DLN] + e0, dres, (size_t)r0, (size_t)n, m->cfg.channels, &m->layout, s);
    return m->grad_act[GRAD_DLN] + e0;
}

/* What layer l did not keep of rows [r0, r0+n) after attention (-r 1, 3:
 * the block from the projection to the GELU; -r 2: LN2 and GELU). */
static void block_recompute_mlp(CpuModel* m, int l, int r0, int n) {
    int mode = m->plan->spec.layer_mode[l], C = m->cfg.channels;
    BlockTensors w = layer_params(m, l);
    if (mode == RECOMPUTE_FULL || mode == RECOMPUTE_KEEP_ATTENTION) { block_forward_mlp(m, l, r0, n, NULL); return; }
    if (mode != RECOMPUTE_SELECTIVE) return;
    layernorm_apply(act_rows(m, l, ACT_LN2, r0), act_rows(m, l, ACT_RES2, r0), act_rows(m, l, ACT_LN2_MEAN, r0),
                    act_rows(m, l, ACT_LN2_RSTD, r0), w.ln2w, w.ln2b, n, C);
    gelu_forward(act_rows(m, l, ACT_FCH_GELU, r0), act_rows(m, l, ACT_FCH, r0), (size_t)n * 4 * C);
}

/* LN1's output of rows [r0, r0+n) where layer l did not keep it: -r 2 from
 * the kept statistics; -r 1 and 3 again from x when another tile has been
 * through the buffer since (else it still holds these rows). */
static void block_recompute_ln1(CpuModel* m, int l, int r0, int n, int tiles) {
    int mode = m->plan->spec.layer_mode[l], C = m->cfg.channels;
    BlockTensors w = layer_params(m, l);
    real *ln1 = act_rows(m, l, ACT_LN1, r0), *x = act_rows(m, l, ACT_X, r0);
    real *mean = act_rows(m, l, ACT_LN1_MEAN, r0), *rstd = act_rows(m, l, ACT_LN1_RSTD, r0);
    if (mode == RECOMPUTE_SELECTIVE) layernorm_apply(ln1, x, mean, rstd, w.ln1w, w.ln1b, n, C);
    else if (mode != RECOMPUTE_NONE && tiles > 1) layernorm_forward(ln1, mean, rstd, x, w.ln1w, w.ln1b, n, C);
}

/* Rows [r0, r0+n) of the block's backward after its output (with what it
 * did not keep of them recomputed first): the MLP, LN2 and the attention
 * projection, down to the gradient of attention's output; dres (N,C) rows
 * go from the gradient w.r.t. the block output to that w.r.t. the
 * attention residual. */
static void block_backward_mlp(CpuModel* m, int l, int r0, int n, real* datty) {
    int C = m->cfg.channels;
    BlockTensors w = layer_params(m, l), dw = layer_grads(m, l);
    real* dres = m->grad_act[GRAD_DRES] + (size_t)r0 * C;
    real* dln = m->grad_act[GRAD_DLN] + (size_t)r0 * C;
    real* dfch = act_rows(m, l, ACT_FCH_GELU, r0); /* over the GELU output, once its weight gradient has read it */
    DropoutSite resid_attn = cpu_site(m, DROPOUT_RESID_ATTN, l), resid_mlp = cpu_site(m, DROPOUT_RESID_MLP, l);
    block_recompute_mlp(m, l, r0, n);
    const real* dbranch = branch_grad(m, &resid_mlp, r0, n);
    matmul_backward_weight(dw.fcprojw, dw.fcprojb, dbranch, act_rows(m, l, ACT_FCH_GELU, r0), n, 4 * C, C);
    matmul_backward_input(dfch, dbranch, w.fcprojw, n, 4 * C, C);
    gelu_backward(dfch, act_rows(m, l, ACT_FCH, r0), (size_t)n * 4 * C);
    matmul_backward_input(dln, dfch, w.fcw, n, C, 4 * C);
    matmul_backward_weight(dw.fcw, dw.fcb, dfch, act_rows(m, l, ACT_LN2, r0), n, C, 4 * C);
    layernorm_backward(dres, dw.ln2w, dw.ln2b, dln, act_rows(m, l, ACT_RES2, r0), w.ln2w, act_rows(m, l, ACT_LN2_MEAN, r0),
                       act_rows(m, l, ACT_LN2_RSTD, r0), n, C);
    dbranch = branch_grad(m, &resid_attn, r0, n);
    matmul_backward_input(datty + (size_t)r0 * C, dbranch, w.attprojw, n, C, C);
    matmul_backward_weight(dw.attprojw, dw.attprojb, dbranch, act_rows(m, l, ACT_ATTY, r0), n, C, C);
}

/* Rows [r0, r0+n) of the block's backward below attention: the QKV matmul
 * and LN1; dres rows become the gradient w.r.t. the block input x. */
static void block_backward_qkv(CpuModel* m, int l, int r0, int n, int tiles, const real* dqkv) {
    int C = m->cfg.channels;
    BlockTensors w = layer_params(m, l), dw = layer_grads(m, l);
    real* dres = m->grad_act[GRAD_DRES] + (size_t)r0 * C;
    real* dln = m->grad_act[GRAD_DLN] + (size_t)r0 * C;
    dqkv += (size_t)r0 * 3 * C;
    block_recompute_ln1(m, l, r0, n, tiles);
    matmul_backward_input(dln, dqkv, w.qkvw, n, C, 3 * C);
    matmul_backward_weight(dw.qkvw, dw.qkvb, dqkv, act_rows(m, l, ACT_LN1, r0), n, C, 3 * C);
    layernorm_backward(dres, dw.ln1w, dw.ln1b, dln, act_rows(m, l, ACT_X, r0), w.ln1w, act_rows(m, l, ACT_LN1_MEAN, r0),
                       act_rows(m, l, ACT_LN1_RSTD, r0), n, C);
}

/* Layer l's recompute and backward: attention's inputs whole (qkv, with -r 1
 * attention's output too), then tile by tile the MLP down to the gradient of
 * attention's output, attention's backward, and tile by tile QKV and LN1;
 * weight gradients add up over the tiles in row order, as in one pass.
 * Untiled, the gradients of attention's output and of qkv go over the
 * layer's res2 and fch (plan.h), whose last readers are done by then.
 * dres (N,C): gradient w.r.t. the block output on entry, w.r.t. x on exit. */
static void block_backward(CpuModel* m, int l) {
    int mode = m->plan->spec.layer_mode[l], N = m->B * m->T, tiles = (N + tile_rows(m) - 1) / tile_rows(m);
    DropoutSite att = cpu_site(m, DROPOUT_ATTENTION, l);
    real* datty = m->tile_rows ? m->tile_datty : act(m, l, ACT_RES2);
    real* dqkv = m->tile_rows ? m->tile_dqkv : act(m, l, ACT_FCH);
    if (mode == RECOMPUTE_FULL || mode == RECOMPUTE_KEEP_ATTENTION) FOR_TILES(m, r0, n) block_forward_qkv(m, l, r0, n);
    if (mode == RECOMPUTE_FULL) block_attention_forward(m, l);
    FOR_TILES(m, r0, n) block_backward_mlp(m, l, r0, n, datty);
    layer_attention_backward(m, l, dqkv, datty, &att);
    FOR_TILES(m, r0, n) block_backward_qkv(m, l, r0, n, tiles, dqkv);
}

/* ------------------------------------------------------------------------ */
/* offloaded checkpoints (plan.h): the GPU's copies, done in place here, so  */
/* that the plan's staging ring and host pool are exercised bit for bit      */

/* Bytes of layer activation `a` for the current call's B*T tokens. */
static size_t act_call_bytes(const CpuModel* m, int a) {
    int is_stat;
    return (size_t)m->B * m->T * layer_act_per_token(a, &m->cfg, &is_stat) * sizeof(real);
}

/* Copies layer l's offloaded tensors between its staging slot and the host
 * pool. A slot released (after the copy out, or after the layer's backward)
 * is filled with NaN, as a GPU slot would hold another layer's tensors: a
 * read without its prefetch poisons the result instead of passing. */
static void offload_copy(CpuModel* m, int l, int to_host) {
    int mode = m->plan->spec.layer_mode[l], off = m->plan->spec.layer_offload[l];
    for (int a = 0; a < NUM_LAYER_ACTS; a++) {
        if (!layer_offloads(mode, off, a)) continue;
        char* slot = m->arena + m->plan->layer_act[l][a];
        char* host = m->host_pool + m->plan->host_act[l][a];
        double t0 = m->links.active ? now_ms() : 0.0;
        memcpy(to_host ? host : slot, to_host ? slot : host, act_call_bytes(m, a));
        if (m->links.active) link_times_add(&m->links.host, (double)act_call_bytes(m, a), 1e-3 * (now_ms() - t0));
    }
}

static void offload_release(CpuModel* m, int l) {
    int mode = m->plan->spec.layer_mode[l], off = m->plan->spec.layer_offload[l];
    for (int a = 0; a < NUM_LAYER_ACTS; a++) {
        if (!layer_offloads(mode, off, a)) continue;
        real* slot = (real*)(m->arena + m->plan->layer_act[l][a]);
        size_t n = act_call_bytes(m, a) / sizeof(real);
        for (size_t i = 0; i < n; i++) slot[i] = (real)NAN;
    }
}

/* Embeddings (dropped: layer 0's x holds the dropped sum), all blocks, final
 * LayerNorm, for the B*T tokens in inputs. An offloaded layer's tensors go
 * to the host pool right after its block. */
static void model_forward(CpuModel* m, const int* inputs) {
    int L = m->cfg.num_layers, C = m->cfg.channels, N = m->B * m->T;
    DropoutSite embd = cpu_site(m, DROPOUT_EMBEDDING, 0);
    encoder_forward(act(m, 0, ACT_X), inputs, m->p.wte, m->p.wpe, m->B, C, &m->layout, position_doc_start(m));
    if (embd.threshold) dropout_mask(act(m, 0, ACT_X), act(m, 0, ACT_X), 0, (size_t)N, C, &m->layout, &embd);
    for (int l = 0; l < L; l++) {
        block_forward(m, l, l + 1 < L ? act(m, l + 1, ACT_X) : m->final_res);
        offload_copy(m, l, 1);
        offload_release(m, l);
    }
    layernorm_forward(m->lnf, m->lnf_mean, m->lnf_rstd, m->final_res, m->p.lnfw, m->p.lnfb, N, C);
}

/* Softmax over the first V logits of one row (in place, padded entries left
 * as they are); returns the log of the normaliser plus the maximum. */
static real softmax_row(real* row, int V) {
    real mx = row[0];
    for (int v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
    real sum = 0;
    for (int v = 0; v < V; v++) { row[v] = R_EXP(row[v] - mx); sum += row[v]; }
    for (int v = 0; v < V; v++) row[v] /= sum;
    return mx + R_LOG(sum);
}

/* Whether row n's loss counts: not where its input is end of text under
 * --eod-mask-loss (llmc/documents.h). */
static inline int loss_counts(const CpuModel* m, const int* inputs, int n) {
    return !m->docs.eod_mask_loss || inputs[n] != m->docs.eot_token;
}

/* Logits, loss and (with dloss_per_token != 0) the classifier backward, a
 * chunk of rows at a time: logits (rows,Vp) = lnf @ wte^T, never all of
 * (N,Vp) at once. Writes per-token losses (0 where the loss does not
 * count, and no gradient there); dlnf goes to the dln buffer. */
static void classifier(CpuModel* m, const int* inputs, const int* targets, real dloss_per_token) {
    int C = m->cfg.channels, V = m->cfg.vocab_size, Vp = m->cfg.padded_vocab_size, N = m->B * m->T;
    for (int r0 = 0; r0 < N; r0 += m->logits_rows) {
        int rows = r0 + m->logits_rows <= N ? m->logits_rows : N - r0;
        const real* lnf = m->lnf + (size_t)r0 * C;
        matmul_forward(m->logits, lnf, m->p.wte, NULL, rows, C, Vp);
        #pragma omp parallel for schedule(static)
        for (int r = 0; r < rows; r++) {
            real* row = m->logits + (size_t)r * Vp;
            int target = targets[r0 + r];
            real target_logit = row[target];
            int counts = loss_counts(m, inputs, r0 + r);
            m->losses[r0 + r] = counts ? softmax_row(row, V) - target_logit : 0;
            if (dloss_per_token == 0) continue;
            for (int v = 0; v < V; v++) row[v] = counts ? (row[v] - (v == target ? 1 : 0)) * dloss_per_token : 0;
            for (int v = V; v < Vp; v++) row[v] = 0;
        }
        if (dloss_per_token == 0) continue;
        matmul_backward_input(m->grad_act[GRAD_DLN] + (size_t)r0 * C, m->logits, m->p.wte, rows, C, Vp);
        matmul_backward_weight(m->g.wte, NULL, m->logits, lnf, rows, C, Vp);
    }
}

/* The mean loss over the rows whose loss counts (0 when none does). */
static real mean_loss(const CpuModel* m, const int* inputs) {
    double sum = 0;
    int N = m->B * m->T, counted = 0;
    for (int i = 0; i < N; i++) {
        if (!loss_counts(m, inputs, i)) continue;
        sum += (double)m->losses[i];
        counted++;
    }
    return counted ? (real)(sum / counted) : 0;
}

static void model_backward(CpuModel* m, const int* inputs) {
    int C = m->cfg.channels, N = m->B * m->T;
    real* dres = m->grad_act[GRAD_DRES];
    memset(dres, 0, (size_t)N * C * sizeof(real));
    layernorm_backward(dres, m->g.lnfw, m->g.lnfb, m->grad_act[GRAD_DLN], m->final_res, m->p.lnfw,
                       m->lnf_mean, m->lnf_rstd, N, C);
    int L = m->cfg.num_layers;
    if (L > 0) offload_copy(m, L - 1, 0);
    for (int l = L - 1; l >= 0; l--) {
        if (l > 0) offload_copy(m, l - 1, 0); /* the GPU's prefetch, during layer l's work */
        block_backward(m, l);
        offload_release(m, l);
    }
    DropoutSite embd = cpu_site(m, DROPOUT_EMBEDDING, 0);
    if (embd.threshold) dropout_mask(dres, dres, 0, (size_t)N, C, &m->layout, &embd);
    encoder_backward(m->g.wte, m->g.wpe, dres, inputs, m->B, C, &m->layout, position_doc_start(m));
}

/* ------------------------------------------------------------------------ */
/* data parallelism over MPI (llmc/multiproc.h)                               */

#ifdef USE_MPI
#define MPI_REAL_TYPE (sizeof(real) == 8 ? MPI_DOUBLE : MPI_FLOAT)
#define MPI_CHUNK ((size_t)1 << 30) /* MPI counts are int */

/* Sums gradients across ranks: all of them (all-reduce), or under ZeRO-1
 * only each rank's shard, reduced onto that rank. */
static void cpu_sync_grads(void* ctx) {
    CpuModel* m = (CpuModel*)ctx;
    size_t n = m->plan->num_params;
    if (m->world == 1) return;
    proc_collective_begin(m->zero ? "the gradient reduction onto shards" : "the gradient all-reduce");
    if (!m->zero) {
        for (size_t s = 0; s < n; s += MPI_CHUNK) {
            int k = (int)(n - s < MPI_CHUNK ? n - s : MPI_CHUNK);
            PROC_CALL(MPI_Allreduce, MPI_Iallreduce, MPI_IN_PLACE, m->grads + s, k, MPI_REAL_TYPE, MPI_SUM, MPI_COMM_WORLD);
        }
        proc_collective_end();
        return;
    }
    for (int r = 0; r < m->world; r++) {
        size_t start, count;
        shard_range(n, m->world, r, &start, &count);
        for (size_t s = 0; s < count; s += MPI_CHUNK) {
            int k = (int)(count - s < MPI_CHUNK ? count - s : MPI_CHUNK);
            real* buf = m->grads + start + s;
            if (r == m->rank) PROC_CALL(MPI_Reduce, MPI_Ireduce, MPI_IN_PLACE, buf, k, MPI_REAL_TYPE, MPI_SUM, r, MPI_COMM_WORLD);
            else PROC_CALL(MPI_Reduce, MPI_Ireduce, buf, NULL, k, MPI_REAL_TYPE, MPI_SUM, r, MPI_COMM_WORLD);
        }
    }
    proc_collective_end();
}

/* ZeRO-1: each rank updated its shard; gather every shard to every rank. */
static void cpu_allgather_params(CpuModel* m) {
    size_t n = m->plan->num_params;
    if (n > (size_t)INT_MAX) fail("ZeRO-1 on the CPU supports at most %d parameters", INT_MAX);
    int* counts = (int*)malloc_check((size_t)m->world * sizeof(int), "allgather");
    int* displs = (int*)malloc_check((size_t)m->world * sizeof(int), "allgather");
    for (int r = 0; r < m->world; r++) {
        size_t start, count;
        shard_range(n, m->world, r, &start, &count);
        counts[r] = (int)count;
        displs[r] = (int)start;
    }
    PROC_COLLECTIVE("the parameter all-gather", MPI_Allgatherv, MPI_Iallgatherv, MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, m->params,
                    counts, displs, MPI_REAL_TYPE, MPI_COMM_WORLD);
    free(counts);
    free(displs);
}
#else
static void cpu_sync_grads(void* ctx) { (void)ctx; }
static void cpu_allgather_params(CpuModel* m) { (void)m; }
#endif

/* ------------------------------------------------------------------------ */
/* optimizer                                                                  */

#define NORM_BLOCK 65536 /* fixed partition: the sum does not depend on threads */

/* Norm over this rank's shard (all parameters without ZeRO), summed across
 * ranks when the gradients are sharded. */
static float cpu_grad_norm(void* ctx) {
    CpuModel* m = (CpuModel*)ctx;
    const real* g = m->grads + m->shard_start;
    size_t n = m->shard_count, blocks = ceil_div(n, NORM_BLOCK);
    double total = 0;
    #pragma omp parallel for schedule(static) ordered
    for (size_t b = 0; b < blocks; b++) {
        size_t e = (b + 1) * NORM_BLOCK < n ? (b + 1) * NORM_BLOCK : n;
        double s = 0;
        for (size_t i = b * NORM_BLOCK; i < e; i++) s += (double)g[i] * (double)g[i];
        #pragma omp ordered
        total += s;
    }
    if (m->zero) total = proc_sum(total, "the gradient norm sum");
    return (float)sqrt(total);
}

static void cpu_update(void* ctx, const AdamWStep* s) {
    CpuModel* m = (CpuModel*)ctx;
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    size_t lo = m->shard_start, hi = m->shard_start + m->shard_count;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        size_t begin, end;
        if (!shard_slice(&pl, t, lo, hi, &begin, &end)) continue;
        float wd = param_is_decayed(t) ? s->weight_decay : 0.0f;
        #pragma omp parallel for schedule(static)
        for (size_t i = begin; i < end; i++) {
            size_t k = i - lo; /* index into this rank's optimizer shard */
            float g = (float)m->grads[i] * s->grad_scale;
            float mm = s->beta1 * m->adam_m[k] + (1.0f - s->beta1) * g;
            float vv = s->beta2 * m->adam_v[k] + (1.0f - s->beta2) * g * g;
            m->adam_m[k] = mm;
            m->adam_v[k] = vv;
            float mhat = mm / s->bias_corr1, vhat = vv / s->bias_corr2;
            float p = (float)m->params[i];
            m->params[i] = (real)(p - s->lr * (mhat / (sqrtf(vhat) + s->eps) + wd * p));
        }
    }
    if (m->zero) cpu_allgather_params(m);
}

/* ------------------------------------------------------------------------ */
/* backend                                                                    */

static float cpu_forward_backward(void* ctx, const MicroBatch* mb, float dloss_mean) {
    CpuModel* m = (CpuModel*)ctx;
    m->drop = &m->train_dropout;
    cpu_set_shape(m, m->plan->spec.B, plan_local_T(&m->plan->spec));
    model_forward(m, mb->inputs);
    classifier(m, mb->inputs, mb->targets, (real)dloss_mean / (real)(m->B * m->T));
    model_backward(m, mb->inputs);
    return (float)mean_loss(m, mb->inputs);
}

static void cpu_set_dropout(void* ctx, const DropoutState* d) { ((CpuModel*)ctx)->train_dropout = *d; }

static void cpu_set_documents(void* ctx, const DocumentOptions* d) { ((CpuModel*)ctx)->docs = *d; }

static float cpu_forward_loss(void* ctx, const int* inputs, const int* targets) {
    CpuModel* m = (CpuModel*)ctx;
    m->drop = &dropout_off;
    cpu_set_shape(m, m->plan->spec.B, plan_local_T(&m->plan->spec));
    model_forward(m, inputs);
    classifier(m, inputs, targets, 0);
    return (float)mean_loss(m, inputs);
}

static void cpu_token_losses(void* ctx, float* out) {
    CpuModel* m = (CpuModel*)ctx;
    for (int i = 0; i < m->B * m->T; i++) out[i] = (float)m->losses[i];
}

/* Softmax probabilities over V at local row `row` of the last forward. */
static void cpu_row_probs(CpuModel* m, int row, float* probs) {
    int C = m->cfg.channels, V = m->cfg.vocab_size, Vp = m->cfg.padded_vocab_size;
    matmul_forward(m->logits, m->lnf + (size_t)row * C, m->p.wte, NULL, 1, C, Vp);
    softmax_row(m->logits, V);
    for (int v = 0; v < V; v++) probs[v] = (float)m->logits[v];
}

/* Runs the model on one sequence of len tokens (B=1, T=len, a prefix of the
 * planned buffers) and returns softmax probabilities at its last position.
 * Under context parallelism every member of the group calls it: the
 * sequence, padded past its end to a multiple of 2N tokens (causal: the
 * padding changes nothing before it), is cut into chunks as in training,
 * and the member holding the last position sends the probabilities to the
 * others. */
static void cpu_next_token_probs(void* ctx, const int* tokens, int len, float* probs) {
    CpuModel* m = (CpuModel*)ctx;
    int N = m->cp.degree;
    m->drop = &dropout_off;
    if (N == 1) {
        memcpy(m->inputs, tokens, (size_t)len * sizeof(int));
        cpu_set_shape(m, 1, len);
        if (documents_need_starts(&m->docs)) document_starts_extend(m->doc_start, m->inputs, len, 0, 0, m->docs.eot_token);
        model_forward(m, m->inputs);
        cpu_row_probs(m, len - 1, probs);
        return;
    }
    int padded = (len + 2 * N - 1) / (2 * N) * (2 * N), Tl = padded / N, Tc = Tl / 2;
    cpu_set_shape(m, 1, Tl);
    int* whole = documents_need_starts(&m->docs) ? (int*)malloc_check((size_t)padded * 2 * sizeof(int), "document starts") : NULL;
    for (int p = 0; whole && p < padded; p++) whole[padded + p] = tokens[p < len ? p : 0];
    if (whole) document_starts_extend(whole, whole + padded, padded, 0, 0, m->docs.eot_token);
    for (int i = 0; i < Tl; i++) {
        int pos = token_position(&m->layout, (size_t)i);
        m->inputs[i] = tokens[pos < len ? pos : 0];
        if (whole) m->doc_start[i] = whole[pos];
    }
    free(whole);
    model_forward(m, m->inputs);
    int chunk = (len - 1) / Tc, owner = chunk < N ? chunk : 2 * N - 1 - chunk;
    if (owner == m->cp.member) cpu_row_probs(m, (chunk < N ? 0 : Tc) + (len - 1) % Tc, probs);
    proc_ring_broadcast(probs, (size_t)m->cfg.vocab_size * sizeof(float), owner);
}

static void cpu_zero_grads(void* ctx) {
    CpuModel* m = (CpuModel*)ctx;
    memset(m->grads, 0, m->plan->num_params * sizeof(real));
}

static void cpu_transfer(void* ctx, int tensor, size_t start, size_t n, float* host, int to_host) {
    CpuModel* m = (CpuModel*)ctx;
    if (tensor == TENSOR_PARAMS) {
        for (size_t i = 0; i < n; i++) {
            if (to_host) host[i] = (float)m->params[start + i];
            else m->params[start + i] = (real)host[i];
        }
        return;
    }
    if (tensor == TENSOR_MASTER) fail("the CPU trainer keeps no master weights");
    if (start < m->shard_start || start + n > m->shard_start + m->shard_count)
        fail("optimizer state range outside this rank's shard");
    float* dst = (tensor == TENSOR_ADAM_M ? m->adam_m : m->adam_v) + (start - m->shard_start);
    if (to_host) memcpy(host, dst, n * sizeof(float));
    else memcpy(dst, host, n * sizeof(float));
}

/* matmul_half_rows timed after the profiled step: layer 0's MLP matmul
 * (C -> 4C) from its ln2 rows into its fch, at the rows those buffers hold
 * (B*T, or a tile), a half, a quarter and an eighth, three times each
 * after one untimed call. The
 * time is a line in M, (M + h) 8 C^2 / rate (cost_model.h), so with FLOPs
 * as the bytes link_fit's intercept over its slope is h in rows; when the
 * times do not tell (link_fit returns 1), h stays `planned`. Nothing reads
 * these buffers before the next step writes them. */
static double cpu_time_matmul_half_rows(CpuModel* m, double planned) {
    int C = m->cfg.channels, rows = m->B * m->T;
    if (m->tile_rows && m->tile_rows < rows) rows = m->tile_rows;
    BlockTensors w = layer_params(m, 0);
    double per_row = 8.0 * C * C, rate = 0.0, intercept = 0.0;
    LinkTimes t = {0, 0, 0, 0, 0};
    for (int i = -1; i < 12; i++) { /* i = -1: untimed, to warm the caches */
        int M = rows >> (i < 0 ? 0 : i % 4) > 0 ? rows >> (i < 0 ? 0 : i % 4) : 1;
        double t0 = now_ms();
        matmul_forward(act(m, 0, ACT_FCH), act(m, 0, ACT_LN2), w.fcw, w.fcb, M, C, 4 * C);
        if (i >= 0) link_times_add(&t, M * per_row, 1e-3 * (now_ms() - t0));
    }
    return link_fit(&t, 0.0, &rate, &intercept) == 0 ? intercept * rate / per_row : planned;
}

static void cpu_step_begin(void* ctx, int step) {
    CpuModel* m = (CpuModel*)ctx;
    m->links.active = m->links.path && step == m->links.step;
}

static void cpu_step_end(void* ctx, int step) {
    CpuModel* m = (CpuModel*)ctx;
    if (!m->links.active) return;
    m->links.active = 0;
#ifdef USE_MPI
    if (m->cp.degree > 1) cpu_time_ring(m);
#endif
    if (m->rank != 0) return;
    const PlanSpec* s = &m->plan->spec;
    CostModel cm = spec_cost_model(s);
    cm.ring_bytes_per_s = cm.ring_latency_s = 0.0; /* only what this run measures */
    int measured = cost_model_add_links(s, &m->links.host, &m->links.ring, &cm);
    cm.matmul_half_rows = cpu_time_matmul_half_rows(m, cm.matmul_half_rows);
    size_t used = strlen(cm.name);
    snprintf(cm.name + used, sizeof(cm.name) - used, ", links measured at B=%d T=%d", s->B, s->T);
    char how[200];
    snprintf(how, sizeof(how), "links and matmul_half_rows timed in step %d (REMAT_PROFILE) of train_gpt_cpu; the other rates as planned", step);
    cost_model_write(&cm, m->links.path, how);
    printf("cost model: %d link%s measured in step %d, written to %s: host link %.3g B/s (%.0f copies), ring %.3g B/s and %.3g s a message (%.0f waits); "
           "matmuls at half rate at %.3g rows\n", measured, measured == 1 ? "" : "s", step, m->links.path, cm.host_link_bytes_per_s,
           m->links.host.count, cm.ring_bytes_per_s, cm.ring_latency_s, m->links.ring.count, cm.matmul_half_rows);
}

static Backend cpu_backend(CpuModel* m) {
    Backend be;
    memset(&be, 0, sizeof(be));
    snprintf(be.device.name, sizeof(be.device.name), "CPU reference (fp32)");
    be.ctx = m;
    be.inputs = m->inputs;
    be.targets = m->targets;
    be.io_chunk = (float*)(m->arena + m->plan->off_io_chunk);
    be.window = (uint16_t*)(m->arena + m->plan->off_loader);
    be.model_file_version = 3;
    be.forward_backward = cpu_forward_backward;
    be.set_dropout = cpu_set_dropout;
    be.set_documents = cpu_set_documents;
    be.doc_start = m->doc_start;
    be.forward_loss = cpu_forward_loss;
    be.token_losses = cpu_token_losses;
    be.next_token_probs = cpu_next_token_probs;
    be.zero_grads = cpu_zero_grads;
    be.sync_grads = cpu_sync_grads;
    be.grad_norm = cpu_grad_norm;
    be.update = cpu_update;
    be.transfer = cpu_transfer;
    be.step_begin = cpu_step_begin;
    be.step_end = cpu_step_end;
    m->links.path = cost_model_profile_request(&m->links.step);
    return be;
}

static void cpu_model_free(CpuModel* m) {
#ifdef USE_MPI
    ring_free(&m->ring);
#endif
    free(m->arena);
    free(m->host_pool);
    free(m->doc_start);
    memset(m, 0, sizeof(*m));
}

#ifndef REMAT_NO_MAIN
int main(int argc, char** argv) {
    proc_init(&argc, &argv);
    Run run;
    run_setup(&run, argc, argv, FOR_CPU, (int)sizeof(real), (int)sizeof(real), 0, 0, CPU_LOGITS_CHUNK_ROWS);
    run_print_header(&run);
#ifdef _OPENMP
    printf("threads: %d (OpenMP)\n", omp_get_max_threads());
#endif
    CpuModel m;
    cpu_model_create(&m, &run.plan);
    Backend be = cpu_backend(&m);
    train(&run, &be);
    cpu_model_free(&m);
    plan_free(&run.plan);
    free(run.layer_mode);
    free(run.layer_offload);
    proc_finalize();
    return 0;
}
#endif
