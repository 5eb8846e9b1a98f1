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
 *
 * One block with named switches (llmc/core/model.h's ModelConfig, the
 * widths from block_widths): LayerNorm or RMSNorm; learned positions or
 * RoPE on Q and K; NH query heads and NKV K/V heads of HD (GPT-2: NKV = NH,
 * HD = C/NH), so qkv is (N, QKV) with QKV = (NH + 2 NKV) HD; GELU of width
 * F or SwiGLU down(silu(gate) * up), the FC matmul then 2F wide; biases per
 * the mask; the classifier wte or an untied lm_head.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "llmc/run/trainer.h"

#include "llmc/cpu/cpu_real.h"
#include "llmc/cpu/cpu_matmul.h"
#include "llmc/cpu/cpu_offload.h"
#include "llmc/cpu/cpu_adamw.h"
#include "llmc/cpu/cpu_data_parallel.h"
#include "llmc/cpu/cpu_calibrate.h"
#include "llmc/cpu/cpu_ring.h" /* context parallelism: attention_tile_* below on llmc/core/ring.h's schedule */
#include "llmc/cpu/cpu_threads.h"

#define CPU_LOGITS_CHUNK_ROWS 256
#define LN_EPS 1e-5

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
        real* dst = x + (size_t)bt * C;
        if (!wpe) { /* RoPE: positions enter in attention */
            for (int c = 0; c < C; c++) dst[c] = te[c];
            continue;
        }
        const real* pe = wpe + (size_t)encoder_position(lay, pos_start, (size_t)bt) * C;
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
    if (!dwpe) return; /* RoPE: no position table */
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
        if (!b) { /* no bias (RMSNorm: m = 0, so x * rstd * w in transformers' order) */
            for (int c = 0; c < C; c++) o[c] = (xr[c] - m) * s * w[c];
            continue;
        }
        for (int c = 0; c < C; c++) o[c] = (xr[c] - m) * s * w[c] + b[c];
    }
}

static void layernorm_forward_eps(real* out, real* mean, real* rstd, const real* x, const real* w, const real* b, int N, int C, real eps) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real* xr = x + (size_t)n * C;
        real m = 0, v = 0;
        for (int c = 0; c < C; c++) m += xr[c];
        m /= (real)C;
        for (int c = 0; c < C; c++) v += (xr[c] - m) * (xr[c] - m);
        v /= (real)C;
        mean[n] = m;
        rstd[n] = (real)1 / R_SQRT(v + eps);
    }
    layernorm_apply(out, x, mean, rstd, w, b, N, C);
}

static void layernorm_forward(real* out, real* mean, real* rstd, const real* x, const real* w, const real* b, int N, int C) {
    layernorm_forward_eps(out, mean, rstd, x, w, b, N, C, (real)LN_EPS);
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
        real gw = dw[c], gb = db ? db[c] : 0; /* db NULL: a LayerNorm without bias */
        for (int n = 0; n < N; n++) {
            real dv = dout[(size_t)n * C + c];
            gw = madd(gw, dv * (x[(size_t)n * C + c] - mean[n]), rstd[n]);
            gb += dv;
        }
        dw[c] = gw;
        if (db) db[c] = gb;
    }
}

/* ------------------------------------------------------------------------ */
/* rmsnorm over C (Llama, Qwen2): out (N,C) = x * rstd * w, rstd (N) =       */
/* 1 / sqrt(mean(x^2) + eps), no mean subtracted and no bias. transformers    */
/* takes the statistics in fp32 and multiplies by the weight last; so does    */
/* layernorm_apply with mean 0 (mean (N) holds 0s, so recomputation from the  */
/* kept statistics is layernorm_apply's too).                                 */

static void rmsnorm_forward(real* out, real* mean, real* rstd, const real* x, const real* w, int N, int C, real eps) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real* xr = x + (size_t)n * C;
        real ss = 0;
        for (int c = 0; c < C; c++) ss += xr[c] * xr[c];
        ss /= (real)C;
        mean[n] = 0;
        rstd[n] = (real)1 / R_SQRT(ss + eps);
    }
    layernorm_apply(out, x, mean, rstd, w, NULL, N, C);
}

/* dx (N,C) += input gradient; dw (C) += weight gradient. With y = x r and
 * g = dout w: dx = r (g - y mean(g y)) (LayerNorm's without the mean terms). */
static void rmsnorm_backward(real* dx, real* dw, const real* dout, const real* x, const real* w, const real* rstd, int N, int C) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real* xr = x + (size_t)n * C;
        const real* d = dout + (size_t)n * C;
        real s = rstd[n], g_dot_y = 0;
        for (int c = 0; c < C; c++) g_dot_y += d[c] * w[c] * (xr[c] * s);
        g_dot_y /= (real)C;
        real* dxr = dx + (size_t)n * C;
        for (int c = 0; c < C; c++) dxr[c] += s * (d[c] * w[c] - xr[c] * s * g_dot_y);
    }
    #pragma omp parallel for schedule(static)
    for (int c = 0; c < C; c++) {
        real gw = dw[c];
        for (int n = 0; n < N; n++) gw = madd(gw, dout[(size_t)n * C + c] * x[(size_t)n * C + c], rstd[n]);
        dw[c] = gw;
    }
}

/* ------------------------------------------------------------------------ */
/* RoPE on the Q and K heads of qkv (N, QKV), in place, rotate_half pairing:  */
/* in each head of HD, channel j < HD/2 pairs with j + HD/2 and the pair       */
/* turns by pos * inv_freq[j] (Hugging Face's layout: its weights load as     */
/* they are). Angles, cos and sin in double from the token's position (fp32   */
/* angles drift by about 0.06 rad at position 10^6); cos and sin carry yarn's */
/* attention factor, as transformers scales them.                            */

typedef struct {
    double* inv_freq; /* (HD/2) per-pair frequencies after scaling */
    double mscale;    /* yarn's attention factor (1 otherwise) */
} Rope;

/* Turns the Q and K heads (the first `heads` heads of HD) of local rows
 * [r0, r0+n) of qkv (its rows ld apart, qkv at row r0) by each token's
 * position, the one the learned table would use (encoder_position: its
 * place in the sequence, under the ring the global one, with documents
 * from its document's start); sign -1 turns back: the transpose, which
 * the backward applies to the gradient. */
static void rope_rotate(real* qkv, int ld, const TokenLayout* lay, const int* pos_start, int r0, int n, int heads, int HD, const Rope* r,
                        int sign) {
    int half = HD / 2;
    #pragma omp parallel
    {
        real* cs = (real*)malloc_check((size_t)HD * sizeof(real), "rope");
        #pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            double pos = (double)encoder_position(lay, pos_start, (size_t)(r0 + i));
            for (int j = 0; j < half; j++) {
                double angle = pos * r->inv_freq[j];
                cs[j] = (real)(cos(angle) * r->mscale);
                cs[half + j] = (real)(sign * sin(angle) * r->mscale);
            }
            real* row = qkv + (size_t)i * ld;
            for (int h = 0; h < heads; h++) {
                real* x = row + (size_t)h * HD;
                for (int j = 0; j < half; j++) {
                    real a = x[j], b = x[j + half], co = cs[j], si = cs[half + j];
                    x[j] = a * co - b * si;
                    x[j + half] = b * co + a * si;
                }
            }
        }
        free(cs);
    }
}

/* ------------------------------------------------------------------------ */
/* SwiGLU (Llama's MLP): fch (N, 2F) = [gate | up] rows, out (N, F) =          */
/* silu(gate) * up, silu(g) = g / (1 + exp(-g)).                              */

static __attribute__((noinline)) void swiglu_forward(real* out, const real* fch, int N, int F) {
    double t0 = cpu_op_begin(); /* the calibration prices it with GELU, the activation family */
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const real* g = fch + (size_t)n * 2 * F;
        const real* u = g + F;
        real* o = out + (size_t)n * F;
        for (int i = 0; i < F; i++) o[i] = g[i] / ((real)1 + R_EXP(-g[i])) * u[i];
    }
    cpu_op_end(OP_GELU, t0);
}

/* fch (N, 2F): [gate | up] on entry, their gradients on exit, from dout (N, F):
 * d gate = dout up silu'(gate), d up = dout silu(gate), each element read
 * before it is written over. */
static void swiglu_backward(real* fch, const real* dout, int N, int F) {
    double t0 = cpu_op_begin();
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        real* g = fch + (size_t)n * 2 * F;
        real* u = g + F;
        const real* d = dout + (size_t)n * F;
        for (int i = 0; i < F; i++) {
            real sig = (real)1 / ((real)1 + R_EXP(-g[i])), silu = g[i] * sig;
            real dgate = d[i] * u[i] * sig * ((real)1 + g[i] * ((real)1 - sig));
            u[i] = d[i] * silu;
            g[i] = dgate;
        }
    }
    cpu_op_end(OP_GELU, t0);
}

/* ------------------------------------------------------------------------ */
/* attention: qkv (B,T,QKV) = [q | k | v], QKV = (NH + 2 NKV) HD, query head */
/* h at channels h*HD, K/V head g at NH HD + g*HD and (NH + NKV) HD + g*HD;    */
/* query head h reads K/V head h / (NH/NKV), no copies (GPT-2: NKV = NH,      */
/* HD = C/NH, QKV = 3C); out (B,T,NH HD); lse (B,NH,T) = log-sum-exp of each  */
/* row's scaled scores.                                                       */
/* No (T,T) matrix: forward uses an online softmax, backward recomputes the   */
/* probabilities from lse, one score at a time. With dropout (drop not NULL,  */
/* threshold > 0) out = (mask * P / keep) V; lse stays that of P, and since   */
/* dO.out = sum of dP' P' over the dropped P', the backward's row term does    */
/* not change: dS = P (mask dP' / keep - dO.out).                             */

/* Sets a block's head geometry from the model's widths. */
static void attention_set_heads(AttentionTile* a, const BlockWidths* w) {
    a->NKV = w->NKV;
    a->HD = w->HD;
}

/* A block's heads: NKV K/V heads of hs, its row widths (qkv's, out's) and
 * the offset of V after K in a K/V row (GPT-2's when the block has none set). */
typedef struct { int NKV, hs, group, q_ld, out_ld, v_off; } AttentionHeads;

static inline AttentionHeads attention_heads(const AttentionTile* a) {
    AttentionHeads g;
    g.NKV = a->NKV ? a->NKV : a->NH;
    g.hs = a->HD ? a->HD : a->C / a->NH;
    g.group = a->NH / g.NKV;
    g.out_ld = a->NH * g.hs;
    g.v_off = g.NKV * g.hs;
    g.q_ld = g.out_ld + 2 * g.v_off;
    return g;
}

/* The dropout factor of probability (t, u) of head bh: 0 or 1/keep. */
static inline real attention_dropout_factor(const DropoutSite* drop, int bh, int T, int t, int u) {
    if (!drop || !drop->threshold) return 1;
    return dropout_keep_attention(drop, bh, T, t, u) ? (real)drop->scale : 0;
}

/* Merges one tile's normalised output `part` (hs) and log-sum-exp `l` into
 * the running o (hs) and *lse: both are softmax-weighted means over disjoint
 * key sets, so the union's is their mean weighted by exp(lse - new lse). */
static inline void attention_merge(real* o, real* lse, const real* part, real l, int hs) {
    real m = *lse > l ? *lse : l;
    real merged = m + R_LOG(R_EXP(*lse - m) + R_EXP(l - m));
    real w0 = R_EXP(*lse - merged), w1 = R_EXP(l - merged);
    for (int i = 0; i < hs; i++) o[i] = o[i] * w0 + part[i] * w1;
    *lse = merged;
}

/* out (B,Tl,NH HD), lse (B,NH,Tl): the tile's rows written (first) or
 * merged into (a later tile of the same queries). q from qkv (B,Tl,QKV);
 * keys from kv, a (B,Tl,ld) tensor whose rows hold K heads at channel 0 and
 * V heads at NKV HD. */
static void attention_tile_forward(real* out, real* lse, const real* qkv, const real* kv, int ld, const AttentionTile* a,
                                   int first, const DropoutSite* drop) {
    AttentionHeads g = attention_heads(a);
    int C = g.out_ld, NH = a->NH, hs = g.hs, Tl = a->Tl;
    real scale = (real)1 / R_SQRT((real)hs);
    #pragma omp parallel
    {
        real* part = first ? NULL : (real*)malloc_check((size_t)hs * sizeof(real), "attention tile");
        #pragma omp for schedule(static)
        for (int bh = 0; bh < a->B * NH; bh++) {
            int b = bh / NH, h = bh % NH;
            for (int i = 0; i < a->Tq; i++) {
                int seen = tile_keys_seen(a, i), from = tile_keys_first(a, b, i), t = a->q0 + i;
                size_t row = (size_t)b * Tl + a->qi + i;
                if (seen == 0) continue; /* the causal mask empties the row here: the tile leaves it alone */
                if (from >= seen) { /* documents: no key here; a query's first tile then holds nothing (lse -inf) for later ones to merge into */
                    if (!first) continue;
                    for (int d = 0; d < hs; d++) out[row * C + h * hs + d] = 0;
                    lse[((size_t)b * NH + h) * Tl + a->qi + i] = -INFINITY;
                    continue;
                }
                const real* q = qkv + row * g.q_ld + h * hs;
                real* o = first ? out + row * C + h * hs : part;
                real run_max = -INFINITY, run_sum = 0;
                for (int d = 0; d < hs; d++) o[d] = 0;
                for (int j = from; j < seen; j++) {
                    const real* k = kv + ((size_t)b * Tl + a->ki + j) * ld + h / g.group * hs;
                    const real* v = k + g.v_off;
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

/* The tile's share of the backward: dq (in dqkv (B,Tl,QKV)) and dk, dv
 * (in dkv, (B,Tl,ld) with dK at 0 and dV at NKV HD) accumulate; out and lse
 * are the merged ones of all tiles. Each (b, K/V head) job owns that head's
 * dK/dV slices and its query heads' dQ, so parallel jobs never write the
 * same element; a K/V head's gradient sums over its query heads in order. */
static void attention_tile_backward(real* dqkv, real* dkv, int dld, const real* dout, const real* qkv, const real* kv, int ld,
                                    const real* out, const real* lse, const AttentionTile* a, const DropoutSite* drop) {
    AttentionHeads g = attention_heads(a);
    int C = g.out_ld, NH = a->NH, hs = g.hs, Tl = a->Tl;
    real scale = (real)1 / R_SQRT((real)hs);
    #pragma omp parallel for schedule(static)
    for (int bg = 0; bg < a->B * g.NKV; bg++)
    for (int h = bg % g.NKV * g.group; h < (bg % g.NKV + 1) * g.group; h++) {
        int b = bg / g.NKV, bh = b * NH + h;
        for (int i = 0; i < a->Tq; i++) {
            int seen = tile_keys_seen(a, i), from = tile_keys_first(a, b, i), t = a->q0 + i;
            size_t row = (size_t)b * Tl + a->qi + i;
            const real* q = qkv + row * g.q_ld + h * hs;
            const real* o = out + row * C + h * hs;
            const real* dO = dout + row * C + h * hs;
            real* dq = dqkv + row * g.q_ld + h * hs;
            real row_lse = lse[((size_t)b * NH + h) * Tl + a->qi + i], d_dot_o = 0;
            for (int d = 0; d < hs; d++) d_dot_o += dO[d] * o[d];
            for (int j = from; j < seen; j++) {
                size_t row2 = (size_t)b * Tl + a->ki + j;
                const real* k = kv + row2 * ld + h / g.group * hs;
                const real* v = k + g.v_off;
                real* dk = dkv + row2 * dld + h / g.group * hs;
                real* dv = dk + g.v_off;
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
static void attention_forward_heads(real* out, real* lse, const real* qkv, int B, int T, int C, const BlockWidths* w, const int* doc_start,
                                    const DropoutSite* drop) {
    AttentionTile a = whole_sequence(B, T, C, w->NH);
    a.doc_start = doc_start;
    attention_set_heads(&a, w);
    attention_tile_forward(out, lse, qkv, qkv + w->q_width, w->qkv_width, &a, 1, drop);
}

/* dqkv (B,T,QKV) is overwritten. */
static void attention_backward_heads(real* dqkv, const real* dout, const real* qkv, const real* out, const real* lse,
                                     int B, int T, int C, const BlockWidths* w, const int* doc_start, const DropoutSite* drop) {
    AttentionTile a = whole_sequence(B, T, C, w->NH);
    a.doc_start = doc_start;
    attention_set_heads(&a, w);
    memset(dqkv, 0, (size_t)B * T * w->qkv_width * sizeof(real));
    attention_tile_backward(dqkv, dqkv + w->q_width, w->qkv_width, dout, qkv, qkv + w->q_width, w->qkv_width, out, lse, &a, drop);
}

/* GPT-2's heads (NH of C/NH): the whole-sequence attention the tests (and
 * the GPU's, test_gpt.cu) compare with; inline, as the trainer itself runs
 * the _heads versions. */
static inline BlockWidths gpt2_heads(int C, int NH) {
    ModelConfig c;
    memset(&c, 0, sizeof(c));
    c.channels = C;
    c.num_heads = NH;
    return block_widths(&c);
}

static inline void attention_forward(real* out, real* lse, const real* qkv, int B, int T, int C, int NH, const int* doc_start,
                                     const DropoutSite* drop) {
    BlockWidths w = gpt2_heads(C, NH);
    attention_forward_heads(out, lse, qkv, B, T, C, &w, doc_start, drop);
}

static inline void attention_backward(real* dqkv, const real* dout, const real* qkv, const real* out, const real* lse, int B, int T, int C,
                                      int NH, const int* doc_start, const DropoutSite* drop) {
    BlockWidths w = gpt2_heads(C, NH);
    attention_backward_heads(dqkv, dout, qkv, out, lse, B, T, C, &w, doc_start, drop);
}

/* ------------------------------------------------------------------------ */
/* GELU, tanh approximation, elementwise over n values                       */

#define GELU_K 0.7978845608028654 /* sqrt(2/pi) */

static __attribute__((noinline)) void gelu_forward(real* out, const real* x, size_t n) {
    double t0 = cpu_op_begin();
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real v = x[i];
        out[i] = (real)0.5 * v * ((real)1 + R_TANH((real)GELU_K * (v + (real)0.044715 * v * v * v)));
    }
    cpu_op_end(OP_GELU, t0);
}

/* d (n) holds the output gradient on entry and the input gradient on exit. */
static void gelu_backward(real* d, const real* x, size_t n) {
    double t0 = cpu_op_begin();
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        real v = x[i];
        real th = R_TANH((real)GELU_K * (v + (real)0.044715 * v * v * v));
        real dudx = (real)GELU_K * ((real)1 + (real)3 * (real)0.044715 * v * v);
        d[i] *= (real)0.5 * ((real)1 + th) + (real)0.5 * v * ((real)1 - th * th) * dudx;
    }
    cpu_op_end(OP_GELU, t0);
}

/* ------------------------------------------------------------------------ */
/* dropout at the embedding and residual sites, elementwise over n values of */
/* a (B,T,C) tensor (llmc/core/dropout.h: one generator call per 8 elements)       */

/* Element e's factor at site s given its call's words: 1/keep or 0. A select,
 * not a product with 0, so a dropped inf stays out of the sum. */
static inline real dropout_value(const DropoutSite* s, const uint32_t* words, size_t e, real v) {
    return dropout_keeps(s, words, (int)(e & 7)) ? v * (real)s->scale : 0;
}

/* Element i of a dropped tensor at site s (e: its global element, words:
 * its generator call's), plus res[i] where res is given (a residual add).
 * The residual add is one rounding, madd's (cpu_matmul.h): GCC contracts
 * this sum into a fused multiply-add where it can, and spelling that out
 * keeps the bits whatever the loop around it looks like. */
static inline real dropout_element(const DropoutSite* s, const uint32_t* words, size_t e, const real* src, const real* res, size_t i) {
    if (!res) return dropout_value(s, words, e, src[i]);
    return dropout_keeps(s, words, (int)(e & 7)) ? madd(res[i], src[i], (real)s->scale) : (real)0 + res[i];
}

/* out = src with site s's mask and scale, plus res where res is given (a
 * residual add), on `rows` token rows of C from local row r0 (a token
 * tile's, or all of them); out may be src. Element c of local row r is
 * element (row0 + token_global_row(r)) * C + c of the whole batch (row0: the
 * global row of this rank's first sequence), so a rank holding some of a
 * sequence's tokens (context parallelism), or some of the batch's
 * sequences, draws the bits one process holding all of them draws. Whole
 * sequences (group_size 1) number elements contiguously from (row0 + r0) C: one
 * generator call per 8 elements. */
static void dropout_rows(real* out, const real* src, const real* res, size_t r0, size_t rows, int C, const TokenLayout* lay,
                         const DropoutSite* s) {
    if (lay->group_size == 1) {
        size_t e0 = (s->row0 + r0) * (size_t)C, n = rows * (size_t)C;
        #pragma omp parallel for schedule(static)
        for (size_t g = e0 / 8; g < (e0 + n + 7) / 8; g++) {
            uint32_t w[4];
            dropout_draws(s, g, w);
            size_t lo = g * 8 > e0 ? g * 8 : e0, hi = g * 8 + 8 < e0 + n ? g * 8 + 8 : e0 + n;
            for (size_t e = lo; e < hi; e++) out[e - e0] = dropout_element(s, w, e, src, res, e - e0);
        }
        return;
    }
    #pragma omp parallel for schedule(static)
    for (size_t r = 0; r < rows; r++) {
        size_t ge0 = (s->row0 + token_global_row(lay, r0 + r)) * (size_t)C;
        uint32_t w[4];
        for (int c = 0; c < C; c++) {
            size_t e = ge0 + (size_t)c, i = r * (size_t)C + (size_t)c;
            if (c == 0 || (e & 7) == 0) dropout_draws(s, e >> 3, w);
            out[i] = dropout_element(s, w, e, src, res, i);
        }
    }
}

/* dst = src with site s's mask and scale (in place when dst == src), rows
 * [r0, r0+rows) of C (dst and src point at the first of them). */
static void dropout_mask(real* dst, const real* src, size_t r0, size_t rows, int C, const TokenLayout* lay, const DropoutSite* s) {
    dropout_rows(dst, src, NULL, r0, rows, C, lay, s);
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
    dropout_rows(out, branch, res, r0, rows, C, lay, s);
}

/* ------------------------------------------------------------------------ */
/* the model                                                                  */

typedef PARAM_TENSORS(real) ParamTensors;
typedef BLOCK_TENSORS(real) BlockTensors;

typedef struct {
    ModelConfig cfg;             /* resolved: every switch set (config_resolved) */
    BlockWidths w;               /* the block's widths (block_widths) */
    Rope rope;                   /* RoPE's frequencies (positions POS_ROPE) */
    const MemoryPlan* plan;
    char* arena;
    char* host_pool;             /* offloaded checkpoints (plan.h): a second allocation, standing in for pinned memory */
    real* params;
    real* grads;
    float* adam_m;
    float* adam_v;
    real* host_params;           /* --offload-optimizer: this rank's shard of the parameters in the host pool, which AdamW updates */
    real* host_grads;            /* and the shard's gradients, copied down before it (cpu_update) */
    ParamTensors p;              /* the parameters by name, views into params */
    ParamTensors g;              /* their gradients, views into grads */
    size_t layer_stride[NUM_PARAM_TENSORS]; /* elements per layer of a stacked tensor */
    int* inputs;                 /* (B, T) the data loader's token buffers (Backend.inputs) */
    int* targets;
    real* losses;                /* (N) per-token loss */
    int* top1;                   /* (N) forward_loss's most probable tokens */
    real* final_res;             /* (N,C) output of the last block */
    real* lnf;                   /* (N,C) */
    real* lnf_mean;
    real* lnf_rstd;
    real* logits;                /* (chunk rows, Vp) */
    int logits_rows;
    real* grad_act[NUM_GRAD_ACTS];
    int tile_tokens;             /* token tiles: tokens per tile (0: untiled, one tile of B*T rows) */
    real* whole_datty;            /* plan_own_attention_grads: (N,NH HD) gradient of attention's output, (N,QKV) of qkv */
    real* whole_dqkv;
    int B, T;                    /* shape of the current call; at most the plan's */
    int rank, world;             /* data parallelism */
    RankParallel par;            /* context-parallel group, ring chunks, ZeRO-1 shard (llmc/run/rank_parallel.h) */
    TokenLayout layout;          /* where the current call's token rows sit in their sequences */
    CpuRing ring;                /* context parallelism: its buffers and messages (llmc/cpu/cpu_ring.h) */
    CpuStepProfile profile;      /* REMAT_PROFILE_COST_MODEL: the step whose ops and transfers are timed */
    CpuOffload offload;          /* the plan's staging slots and host pool; offload.timed during the profiled step */
    DropoutState train_dropout;  /* set_dropout's: what forward_backward drops */
    const DropoutState* drop;    /* the running pass's: &train_dropout, or &dropout_off */
    DocumentOptions docs;        /* packed documents (llmc/core/documents.h; eot_token -1: off) */
    int* doc_start;              /* (B,T) document starts of the current call's rows (Backend.doc_start; NULL without documents) */
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

/* Layer l's slice of the block tensors of `all` (the parameters or their
 * gradients), by name. */
static inline BlockTensors layer_slice(const CpuModel* m, const ParamTensors* all, int l) {
    BlockTensors b;
    for (int t = 0; t < NUM_BLOCK_TENSORS; t++)
        b.tensor[t] = all->tensor[FIRST_BLOCK_TENSOR + t] + (size_t)l * m->layer_stride[FIRST_BLOCK_TENSOR + t];
    return b;
}

/* A block tensor the switches leave out (a bias) is NULL. */
static inline BlockTensors absent_to_null(const CpuModel* m, BlockTensors w) {
    for (int t = 0; t < NUM_BLOCK_TENSORS; t++)
        if (m->layer_stride[FIRST_BLOCK_TENSOR + t] == 0) w.tensor[t] = NULL;
    return w;
}

static inline BlockTensors layer_params(const CpuModel* m, int l) { return absent_to_null(m, layer_slice(m, &m->p, l)); }
static inline BlockTensors layer_grads(const CpuModel* m, int l) { return absent_to_null(m, layer_slice(m, &m->g, l)); }

/* The classifier's weights (Vp, C) and their gradient: wte, or the untied lm_head. */
static inline real* head_weights(const CpuModel* m) { return m->cfg.tied ? m->p.wte : m->p.lm_head; }
static inline real* head_grads(const CpuModel* m) { return m->cfg.tied ? m->g.wte : m->g.lm_head; }

/* The norms of the block and the final one: LayerNorm (bias b, or none) or
 * RMSNorm (b unused), with the configuration's epsilon. */
static void norm_forward(const CpuModel* m, real* out, real* mean, real* rstd, const real* x, const real* w, const real* b, int N) {
    int C = m->cfg.channels;
    if (m->cfg.norm == NORM_RMSNORM) rmsnorm_forward(out, mean, rstd, x, w, N, C, (real)m->cfg.norm_eps);
    else if (m->cfg.family == FAMILY_GPT2 && m->cfg.norm_eps == 1e-5f) layernorm_forward(out, mean, rstd, x, w, b, N, C);
    else layernorm_forward_eps(out, mean, rstd, x, w, b, N, C, (real)m->cfg.norm_eps);
}

/* The normalisation from kept statistics (RMSNorm's mean slots hold 0). */
static void norm_apply(const CpuModel* m, real* out, const real* x, const real* mean, const real* rstd, const real* w, const real* b, int N) {
    layernorm_apply(out, x, mean, rstd, w, m->cfg.norm == NORM_RMSNORM ? NULL : b, N, m->cfg.channels);
}

static void norm_backward(const CpuModel* m, real* dx, real* dw, real* db, const real* dout, const real* x, const real* w, const real* mean,
                          const real* rstd, int N) {
    if (m->cfg.norm == NORM_RMSNORM) rmsnorm_backward(dx, dw, dout, x, w, rstd, N, m->cfg.channels);
    else layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, m->cfg.channels);
}

/* The shape of the next pass: B rows of T tokens on this rank (under
 * context parallelism its chunks of sequences N T long, those ring_chunks
 * gives it for the batch). */
static void cpu_set_shape(CpuModel* m, int B, int T) {
    m->B = B;
    m->T = T;
    m->layout = token_layout(T, m->par.cp.member, m->par.cp.group_size, m->par.ring_chunks);
}

/* --offload-optimizer: the moments, a copy of the shard's parameters and of
 * its gradients live in the host pool (plan.h), a second allocation standing
 * in for a GPU's pinned memory. The parameters' copy starts as NaN: only a
 * load (cpu_transfer) fills it, so an update from a copy that missed one
 * poisons the model instead of passing. */
static void cpu_optimizer_in_host_pool(CpuModel* m, const MemoryPlan* plan) {
    m->adam_m = (float*)(m->host_pool + plan->off_adam_m);
    m->adam_v = (float*)(m->host_pool + plan->off_adam_v);
    m->host_params = (real*)(m->host_pool + plan->off_master);
    m->host_grads = (real*)(m->host_pool + plan->off_host_grads);
    for (size_t i = 0; i < plan->shard_params; i++) m->host_params[i] = (real)NAN;
}

static void cpu_model_create(CpuModel* m, const MemoryPlan* plan) {
    memset(m, 0, sizeof(*m));
    m->cfg = config_resolved(&plan->spec.cfg);
    m->w = block_widths(&m->cfg);
    if (m->cfg.positions == POS_ROPE) {
        m->rope.inv_freq = (double*)malloc_check((size_t)m->w.HD / 2 * sizeof(double), "RoPE frequencies");
        rope_frequencies(&m->cfg, m->rope.inv_freq, &m->rope.mscale);
    }
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
    CpuOffload offload = {plan, m->arena, m->host_pool, NULL};
    m->offload = offload;
    if (plan->spec.offload_optimizer) cpu_optimizer_in_host_pool(m, plan);
    m->tile_tokens = (int)plan_tile_tokens(&plan->spec);
    if (plan_own_attention_grads(&plan->spec)) {
        m->whole_datty = (real*)(m->arena + plan->off_whole_datty);
        m->whole_dqkv = (real*)(m->arena + plan->off_whole_dqkv);
    }
    memset(m->grads, 0, plan->num_params * sizeof(real));
    memset(m->adam_m, 0, plan->shard_params * sizeof(float));
    memset(m->adam_v, 0, plan->shard_params * sizeof(float));
    m->rank = remat_proc.rank;
    m->world = plan->spec.world_size;
    m->par = rank_parallel(plan, m->rank);
    if (m->par.cp.group_size > 1) {
        size_t block = plan_ring_kv_bytes(&plan->spec) / sizeof(real);
        m->ring.kv[0] = (real*)(m->arena + plan->off_ring_kv);
        m->ring.kv[1] = m->ring.kv[0] + block;
        m->ring.dkv[0] = (real*)(m->arena + plan->off_ring_dkv);
        m->ring.dkv[1] = m->ring.dkv[0] + block;
    }
    cpu_set_shape(m, m->B, m->T);
    m->doc_start = plan->spec.documents & PLAN_DOC_STARTS ? (int*)(m->arena + plan->off_doc_start) : NULL;
    m->top1 = (int*)(m->arena + plan->off_top1);
}

/* Attention of layer l on this rank's tokens: the whole sequence here, or the ring. */
static void layer_attention_forward(CpuModel* m, int l) {
    DropoutSite site = cpu_site(m, DROPOUT_ATTENTION, l), *drop = &site;
    real *out = act(m, l, ACT_ATTY), *lse = act(m, l, ACT_ATT_LSE), *qkv = act(m, l, ACT_QKV);
    const int* docs = attention_doc_start(m);
    double t0 = cpu_op_begin();
    if (m->par.cp.group_size > 1)
        cpu_ring_attention_forward(&m->ring, &m->par.cp, m->par.ring_chunks, m->B, m->T, m->cfg.channels, &m->w, docs, out, lse, qkv, drop);
    else attention_forward_heads(out, lse, qkv, m->B, m->T, m->cfg.channels, &m->w, docs, drop);
    cpu_op_end(OP_ATTENTION_FORWARD, t0);
}

static void layer_attention_backward(CpuModel* m, int l, real* dqkv, const real* datty) {
    DropoutSite site = cpu_site(m, DROPOUT_ATTENTION, l), *drop = &site;
    const real *qkv = act(m, l, ACT_QKV), *out = act(m, l, ACT_ATTY), *lse = act(m, l, ACT_ATT_LSE);
    const int* docs = attention_doc_start(m);
    double t0 = cpu_op_begin();
    if (m->par.cp.group_size > 1)
        cpu_ring_attention_backward(&m->ring, &m->par.cp, m->par.ring_chunks, m->B, m->T, m->cfg.channels, &m->w, docs, dqkv, datty, qkv,
                                    out, lse, drop);
    else attention_backward_heads(dqkv, datty, qkv, out, lse, m->B, m->T, m->cfg.channels, &m->w, docs, drop);
    cpu_op_end(OP_ATTENTION_BACKWARD, t0);
}

/* Rows [r0, ...) of layer l's activation a (plan_act_row_offset: a tiled
 * tensor the layer does not keep holds the current tile from its start). */
static inline real* act_rows(const CpuModel* m, int l, int a, int r0) { return act(m, l, a) + plan_act_row_offset(m->plan, l, a, r0); }

/* The tiles of the current call: rows per tile, all B*T rows untiled. */
static inline int tile_tokens(const CpuModel* m) { return call_tile_tokens((size_t)m->tile_tokens, m->B * m->T); }

/* RoPE on rows [r0, r0+n) of a (rows, QKV) tensor whose row r0 is at x:
 * the Q and K heads turned by each token's position (sign 1), or a
 * gradient turned back (-1); nothing with learned positions. */
static void block_rope(const CpuModel* m, real* x, int r0, int n, int sign) {
    if (m->cfg.positions != POS_ROPE) return;
    rope_rotate(x, m->w.qkv_width, &m->layout, position_doc_start(m), r0, n, m->w.NH + m->w.NKV, m->w.HD, &m->rope, sign);
}

/* Block l up to attention, rows [r0, r0+n): the first norm, the QKV matmul
 * and RoPE (qkv holds Q and K after it: attention, and the ring, read them
 * so), from its stored input x. */
static void block_forward_qkv(CpuModel* m, int l, int r0, int n) {
    int C = m->cfg.channels;
    BlockTensors w = layer_params(m, l);
    real* ln1 = act_rows(m, l, ACT_LN1, r0);
    real* qkv = act_rows(m, l, ACT_QKV, r0);
    norm_forward(m, ln1, act_rows(m, l, ACT_LN1_MEAN, r0), act_rows(m, l, ACT_LN1_RSTD, r0), act_rows(m, l, ACT_X, r0), w.ln1w, w.ln1b, n);
    matmul_forward(qkv, ln1, w.qkvw, w.qkvb, n, C, m->w.qkv_width);
    block_rope(m, qkv, r0, n, 1);
}

/* The MLP's activation, rows of fch (n, fc_width) into out (n, F): GELU, or SwiGLU's product. */
static void block_mlp_activation(CpuModel* m, real* out, const real* fch, int n) {
    if (m->cfg.mlp == MLP_SWIGLU) swiglu_forward(out, fch, n, m->w.F);
    else gelu_forward(out, fch, (size_t)n * m->w.F);
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
    matmul_forward(res2, act_rows(m, l, ACT_ATTY, r0), w.attprojw, w.attprojb, n, m->w.q_width, C);
    residual_add(res2, res2, x, (size_t)r0, (size_t)n, C, &m->layout, &resid_attn);
    norm_forward(m, ln2, act_rows(m, l, ACT_LN2_MEAN, r0), act_rows(m, l, ACT_LN2_RSTD, r0), res2, w.ln2w, w.ln2b, n);
    matmul_forward(fch, ln2, w.fcw, w.fcb, n, C, m->w.fc_width);
    block_mlp_activation(m, fch_gelu, fch, n);
    if (!out) return;
    matmul_forward(out + e0, fch_gelu, w.fcprojw, w.fcprojb, n, m->w.F, C);
    residual_add(out + e0, out + e0, res2, (size_t)r0, (size_t)n, C, &m->layout, &resid_mlp);
}

/* Block l forward from its stored input x, tile by tile but for attention. */
static void block_forward(CpuModel* m, int l, real* out) {
    int N = m->B * m->T, K = tile_tokens(m);
    for (int r0 = 0; r0 < N; r0 += K) block_forward_qkv(m, l, r0, tile_len(r0, K, N));
    layer_attention_forward(m, l);
    for (int r0 = 0; r0 < N; r0 += K) block_forward_mlp(m, l, r0, tile_len(r0, K, N), out);
}

/* The gradient a dropped residual branch receives, rows [r0, r0+n): dres
 * itself without dropout, else dres masked and scaled into GRAD_DBRANCH
 * (dln's buffer, free then: plan.h). */
static const real* branch_grad(CpuModel* m, const DropoutSite* s, int r0, int n) {
    size_t e0 = (size_t)r0 * m->cfg.channels;
    real* dres = m->grad_act[GRAD_DRES] + e0;
    if (!s->threshold) return dres;
    dropout_mask(m->grad_act[GRAD_DBRANCH] + e0, dres, (size_t)r0, (size_t)n, m->cfg.channels, &m->layout, s);
    return m->grad_act[GRAD_DBRANCH] + e0;
}

/* What layer l did not keep of attention's inputs, before its backward
 * (-r 1 and 3: qkv, tile by tile; -r 1: attention's output too). */
static void block_recompute_attention_inputs(CpuModel* m, int l) {
    int mode = m->plan->spec.layer_mode[l], N = m->B * m->T, K = tile_tokens(m);
    if (layer_keeps(mode, ACT_QKV)) return;
    for (int r0 = 0; r0 < N; r0 += K) block_forward_qkv(m, l, r0, tile_len(r0, K, N));
    if (!layer_keeps(mode, ACT_ATTY)) layer_attention_forward(m, l);
}

/* What layer l did not keep of rows [r0, r0+n) after attention (-r 1, 3:
 * the block from the projection to the activation; -r 2: the second norm
 * and the activation, GELU or SwiGLU's product). */
static void block_recompute_mlp(CpuModel* m, int l, int r0, int n) {
    int mode = m->plan->spec.layer_mode[l];
    BlockTensors w = layer_params(m, l);
    if (!layer_keeps(mode, ACT_RES2)) { block_forward_mlp(m, l, r0, n, NULL); return; }
    if (!layer_keeps(mode, ACT_LN2))
        norm_apply(m, act_rows(m, l, ACT_LN2, r0), act_rows(m, l, ACT_RES2, r0), act_rows(m, l, ACT_LN2_MEAN, r0),
                   act_rows(m, l, ACT_LN2_RSTD, r0), w.ln2w, w.ln2b, n);
    if (!layer_keeps(mode, ACT_FCH_GELU)) block_mlp_activation(m, act_rows(m, l, ACT_FCH_GELU, r0), act_rows(m, l, ACT_FCH, r0), n);
}

/* LN1's output of rows [r0, r0+n) where layer l did not keep it: -r 2 from
 * the kept statistics; -r 1 and 3 again from x when another tile has been
 * through the buffer since (else it still holds these rows). */
static void block_recompute_ln1(CpuModel* m, int l, int r0, int n, int tiles) {
    int mode = m->plan->spec.layer_mode[l];
    BlockTensors w = layer_params(m, l);
    real *ln1 = act_rows(m, l, ACT_LN1, r0), *x = act_rows(m, l, ACT_X, r0);
    real *mean = act_rows(m, l, ACT_LN1_MEAN, r0), *rstd = act_rows(m, l, ACT_LN1_RSTD, r0);
    if (layer_keeps(mode, ACT_LN1)) return;
    if (layer_keeps(mode, ACT_LN1_MEAN)) norm_apply(m, ln1, x, mean, rstd, w.ln1w, w.ln1b, n);
    else if (tiles > 1) norm_forward(m, ln1, mean, rstd, x, w.ln1w, w.ln1b, n);
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
    int F = m->w.F, FC = m->w.fc_width, Q = m->w.q_width;
    real* dact = act_rows(m, l, ACT_DFCH, r0); /* over the activation's output, once its weight gradient has read it */
    /* the FC output's gradient: GELU's in place over dact; SwiGLU's (gate and up) over fch itself */
    real* dfch = m->cfg.mlp == MLP_SWIGLU ? act_rows(m, l, ACT_FCH, r0) : dact;
    DropoutSite resid_attn = cpu_site(m, DROPOUT_RESID_ATTN, l), resid_mlp = cpu_site(m, DROPOUT_RESID_MLP, l);
    block_recompute_mlp(m, l, r0, n);
    const real* dbranch = branch_grad(m, &resid_mlp, r0, n);
    matmul_backward_weight(dw.fcprojw, dw.fcprojb, dbranch, act_rows(m, l, ACT_FCH_GELU, r0), n, F, C);
    matmul_backward_input(dact, dbranch, w.fcprojw, n, F, C);
    if (m->cfg.mlp == MLP_SWIGLU) swiglu_backward(dfch, dact, n, F);
    else gelu_backward(dfch, act_rows(m, l, ACT_FCH, r0), (size_t)n * F);
    matmul_backward_input(dln, dfch, w.fcw, n, C, FC);
    matmul_backward_weight(dw.fcw, dw.fcb, dfch, act_rows(m, l, ACT_LN2, r0), n, C, FC);
    norm_backward(m, dres, dw.ln2w, dw.ln2b, dln, act_rows(m, l, ACT_RES2, r0), w.ln2w, act_rows(m, l, ACT_LN2_MEAN, r0),
                  act_rows(m, l, ACT_LN2_RSTD, r0), n);
    dbranch = branch_grad(m, &resid_attn, r0, n);
    matmul_backward_input(datty + (size_t)r0 * Q, dbranch, w.attprojw, n, Q, C);
    matmul_backward_weight(dw.attprojw, dw.attprojb, dbranch, act_rows(m, l, ACT_ATTY, r0), n, Q, C);
}

/* Rows [r0, r0+n) of the block's backward below attention: RoPE turned
 * back on the gradient (in place), the QKV matmul and the first norm; dres
 * rows become the gradient w.r.t. the block input x. */
static void block_backward_qkv(CpuModel* m, int l, int r0, int n, int tiles, real* dqkv) {
    int C = m->cfg.channels, QKV = m->w.qkv_width;
    BlockTensors w = layer_params(m, l), dw = layer_grads(m, l);
    real* dres = m->grad_act[GRAD_DRES] + (size_t)r0 * C;
    real* dln = m->grad_act[GRAD_DLN] + (size_t)r0 * C;
    dqkv += (size_t)r0 * QKV;
    block_recompute_ln1(m, l, r0, n, tiles);
    block_rope(m, dqkv, r0, n, -1);
    matmul_backward_input(dln, dqkv, w.qkvw, n, C, QKV);
    matmul_backward_weight(dw.qkvw, dw.qkvb, dqkv, act_rows(m, l, ACT_LN1, r0), n, C, QKV);
    norm_backward(m, dres, dw.ln1w, dw.ln1b, dln, act_rows(m, l, ACT_X, r0), w.ln1w, act_rows(m, l, ACT_LN1_MEAN, r0),
                  act_rows(m, l, ACT_LN1_RSTD, r0), n);
}

/* Layer l's recompute and backward: attention's inputs whole (qkv, with -r 1
 * attention's output too), then tile by tile the MLP down to the gradient of
 * attention's output, attention's backward, and tile by tile QKV and LN1;
 * weight gradients add up over the tiles in row order, as in one pass.
 * Untiled, the gradients of attention's output and of qkv go over the
 * layer's res2 and fch (plan.h), whose last readers are done by then.
 * dres (N,C): gradient w.r.t. the block output on entry, w.r.t. x on exit. */
static void block_backward(CpuModel* m, int l) {
    int N = m->B * m->T, K = tile_tokens(m), tiles = (N + K - 1) / K;
    real* datty = m->whole_datty ? m->whole_datty : act(m, l, ACT_DATTY);
    real* dqkv = m->whole_dqkv ? m->whole_dqkv : act(m, l, ACT_DQKV);
    block_recompute_attention_inputs(m, l);
    for (int r0 = 0; r0 < N; r0 += K) block_backward_mlp(m, l, r0, tile_len(r0, K, N), datty);
    layer_attention_backward(m, l, dqkv, datty);
    for (int r0 = 0; r0 < N; r0 += K) block_backward_qkv(m, l, r0, tile_len(r0, K, N), tiles, dqkv);
}

/* offloaded checkpoints: llmc/cpu/cpu_offload.h, on this call's B*T tokens */
static void offload_copy(CpuModel* m, int l, int to_host) { cpu_offload_copy(&m->offload, l, (size_t)m->B * m->T, to_host); }
static void offload_release(CpuModel* m, int l) { cpu_offload_release(&m->offload, l, (size_t)m->B * m->T); }

/* Embeddings (dropped: layer 0's x holds the dropped sum), all blocks, final
 * LayerNorm, for the B*T tokens in inputs. An offloaded layer's tensors go
 * to the host pool right after its block. */
static void model_forward(CpuModel* m, const int* inputs) {
    int L = m->cfg.num_layers, C = m->cfg.channels, N = m->B * m->T;
    DropoutSite embd = cpu_site(m, DROPOUT_EMBEDDING, 0);
    encoder_forward(act(m, 0, ACT_X), inputs, m->p.wte, m->cfg.positions == POS_LEARNED ? m->p.wpe : NULL, m->B, C, &m->layout,
                    position_doc_start(m));
    if (embd.threshold) dropout_mask(act(m, 0, ACT_X), act(m, 0, ACT_X), 0, (size_t)N, C, &m->layout, &embd);
    for (int l = 0; l < L; l++) {
        block_forward(m, l, l + 1 < L ? act(m, l + 1, ACT_X) : m->final_res);
        offload_copy(m, l, 1);
        offload_release(m, l);
    }
    norm_forward(m, m->lnf, m->lnf_mean, m->lnf_rstd, m->final_res, m->p.lnfw, m->cfg.bias & BIAS_NORM ? m->p.lnfb : NULL, N);
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

/* The first index of the largest of row[0..V). */
static int argmax_row(const real* row, int V) {
    int best = 0;
    for (int v = 1; v < V; v++)
        if (row[v] > row[best]) best = v;
    return best;
}

/* Whether row n's loss counts: not where its input is end of text under
 * --eod-mask-loss (llmc/core/documents.h). */
static inline int loss_counts(const CpuModel* m, const int* inputs, int n) {
    return !m->docs.eod_mask_loss || inputs[n] != m->docs.eot_token;
}

/* Logits, loss and (with dloss_per_token != 0) the classifier backward, a
 * chunk of rows at a time: logits (rows,Vp) = lnf @ wte^T, never all of
 * (N,Vp) at once. Writes per-token losses (0 where the loss does not
 * count, and no gradient there; without a backward also the top-1 tokens);
 * dlnf goes to the dln buffer. */
static void classifier(CpuModel* m, const int* inputs, const int* targets, real dloss_per_token) {
    int C = m->cfg.channels, V = m->cfg.vocab_size, Vp = m->cfg.padded_vocab_size, N = m->B * m->T;
    for (int r0 = 0; r0 < N; r0 += m->logits_rows) {
        int rows = r0 + m->logits_rows <= N ? m->logits_rows : N - r0;
        const real* lnf = m->lnf + (size_t)r0 * C;
        matmul_forward(m->logits, lnf, head_weights(m), NULL, rows, C, Vp);
        #pragma omp parallel for schedule(static)
        for (int r = 0; r < rows; r++) {
            real* row = m->logits + (size_t)r * Vp;
            int target = targets[r0 + r];
            real target_logit = row[target];
            int counts = loss_counts(m, inputs, r0 + r);
            if (dloss_per_token == 0) m->top1[r0 + r] = argmax_row(row, V);
            m->losses[r0 + r] = counts ? softmax_row(row, V) - target_logit : 0;
            if (dloss_per_token == 0) continue;
            for (int v = 0; v < V; v++) row[v] = counts ? (row[v] - (v == target ? 1 : 0)) * dloss_per_token : 0;
            for (int v = V; v < Vp; v++) row[v] = 0;
        }
        if (dloss_per_token == 0) continue;
        matmul_backward_input(m->grad_act[GRAD_DLN] + (size_t)r0 * C, m->logits, head_weights(m), rows, C, Vp);
        matmul_backward_weight(head_grads(m), NULL, m->logits, lnf, rows, C, Vp);
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

/* Segment checkpointing (plan.h): layers first..last run forward again from
 * the segment's kept input with the very same block functions, so that each
 * layer's slot holds what its mode keeps, bit for bit what the step's
 * forward wrote; the last layer's output is not needed (the next segment is
 * done), so it stops once its kept tensors are written. */
static void segment_forward_again(CpuModel* m, int first, int last) {
    for (int l = first; l < last; l++) block_forward(m, l, act(m, l + 1, ACT_X));
    int mode = m->plan->spec.layer_mode[last], N = m->B * m->T, K = tile_tokens(m);
    if (layer_keeps(mode, ACT_RES2)) block_forward(m, last, NULL); /* what it keeps runs through the MLP */
    else if (layer_keeps(mode, ACT_ATTY)) {                           /* -r 3: up to attention's output; -r 1 keeps x alone */
        for (int r0 = 0; r0 < N; r0 += K) block_forward_qkv(m, last, r0, tile_len(r0, K, N));
        layer_attention_forward(m, last);
    }
}

static void model_backward(CpuModel* m, const int* inputs) {
    int C = m->cfg.channels, N = m->B * m->T;
    real* dres = m->grad_act[GRAD_DRES];
    memset(dres, 0, (size_t)N * C * sizeof(real));
    norm_backward(m, dres, m->g.lnfw, m->cfg.bias & BIAS_NORM ? m->g.lnfb : NULL, m->grad_act[GRAD_DLN], m->final_res, m->p.lnfw,
                  m->lnf_mean, m->lnf_rstd, N);
    int L = m->cfg.num_layers, K = plan_segment_layers(&m->plan->spec);
    if (L > 0) offload_copy(m, (L - 1) / K * K, 0);
    for (int top = L - 1; top >= 0; top = top / K * K - 1) { /* segment by segment (K = 1: layer by layer) */
        int first = top / K * K;
        if (first > 0) offload_copy(m, first - K, 0); /* the GPU's prefetch, during this segment's work */
        if (K > 1 && top < L - 1) segment_forward_again(m, first, top);
        for (int l = top; l >= first; l--) block_backward(m, l);
        for (int l = first; l <= top; l++) offload_release(m, l);
    }
    DropoutSite embd = cpu_site(m, DROPOUT_EMBEDDING, 0);
    if (embd.threshold) dropout_mask(dres, dres, 0, (size_t)N, C, &m->layout, &embd);
    encoder_backward(m->g.wte, m->cfg.positions == POS_LEARNED ? m->g.wpe : NULL, dres, inputs, m->B, C, &m->layout, position_doc_start(m));
}

/* ------------------------------------------------------------------------ */
/* data parallelism over MPI (llmc/core/multiproc.h)                               */

/* Sums gradients across ranks (llmc/cpu/cpu_data_parallel.h). */
static void cpu_sync_grads(void* ctx) {
    CpuModel* m = (CpuModel*)ctx;
    cpu_sum_grads(m->grads, m->plan->num_params, m->par.zero);
}

/* ------------------------------------------------------------------------ */
/* optimizer                                                                  */

/* Norm over this rank's shard (all parameters without ZeRO), summed across
 * ranks when the gradients are sharded (llmc/cpu/cpu_adamw.h). */
static float cpu_grad_norm(void* ctx) {
    CpuModel* m = (CpuModel*)ctx;
    double total = cpu_grad_sumsq(m->grads + m->par.shard_start, m->par.shard_count);
    if (m->par.zero) total = proc_sum(total, "the gradient norm sum");
    return (float)sqrt(total);
}

static void cpu_update(void* ctx, const AdamWStep* s) {
    CpuModel* m = (CpuModel*)ctx;
    ParamLayout pl;
    param_layout(&m->cfg, &pl);
    size_t lo = m->par.shard_start, hi = m->par.shard_start + m->par.shard_count; /* this rank's parameters */
    if (m->host_params) { /* --offload-optimizer: gradients down, AdamW on the host copy, parameters up */
        memcpy(m->host_grads, m->grads + lo, (hi - lo) * sizeof(real));
        cpu_adamw_update(m->host_params, m->host_grads, m->adam_m, m->adam_v, &pl, lo, hi, s);
        memcpy(m->params + lo, m->host_params, (hi - lo) * sizeof(real));
    } else cpu_adamw_update(m->params + lo, m->grads + lo, m->adam_m, m->adam_v, &pl, lo, hi, s);
    if (m->par.zero) cpu_allgather_params(m->params, m->plan->num_params);
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

static void cpu_token_top1(void* ctx, int* out) {
    CpuModel* m = (CpuModel*)ctx;
    memcpy(out, m->top1, (size_t)m->B * m->T * sizeof(int));
}

/* Softmax probabilities over V at local row `row` of the last forward. */
static void cpu_row_probs(CpuModel* m, int row, float* probs) {
    int C = m->cfg.channels, V = m->cfg.vocab_size, Vp = m->cfg.padded_vocab_size;
    matmul_forward(m->logits, m->lnf + (size_t)row * C, head_weights(m), NULL, 1, C, Vp);
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
    int N = m->par.cp.group_size, padded = N > 1 ? ring_padded_length(len, N) : len, row = len - 1;
    m->drop = &dropout_off;
    cpu_set_shape(m, 1, padded / N);
    sampling_rows(&m->layout, m->docs.reset_attention_mask ? m->par.ring_chunks : NULL, tokens, len, padded,
                  documents_need_starts(&m->docs) ? m->docs.eot_token : -1, m->inputs, m->doc_start);
    model_forward(m, m->inputs);
    int owner = N > 1 ? ring_position_owner(len - 1, m->T, N, m->par.ring_chunks, &row) : 0;
    if (owner == m->par.cp.member) cpu_row_probs(m, row, probs);
    proc_ring_broadcast(probs, (size_t)m->cfg.vocab_size * sizeof(float), owner);
}

static void cpu_zero_grads(void* ctx) {
    CpuModel* m = (CpuModel*)ctx;
    memset(m->grads, 0, m->plan->num_params * sizeof(real));
}

/* --offload-optimizer: parameters [start, start + n) just loaded into the
 * arena, copied to the host pool's copy where they fall in this rank's shard. */
static void cpu_load_host_params(CpuModel* m, size_t start, size_t n) {
    size_t lo = m->par.shard_start, hi = lo + m->par.shard_count;
    size_t a = start > lo ? start : lo, b = start + n < hi ? start + n : hi;
    if (a < b) memcpy(m->host_params + (a - lo), m->params + a, (b - a) * sizeof(real));
}

static void cpu_transfer(void* ctx, int tensor, size_t start, size_t n, float* host, int to_host) {
    CpuModel* m = (CpuModel*)ctx;
    if (tensor == TENSOR_PARAMS) {
        for (size_t i = 0; i < n; i++) {
            if (to_host) host[i] = (float)m->params[start + i];
            else m->params[start + i] = (real)host[i];
        }
        if (!to_host && m->host_params) cpu_load_host_params(m, start, n);
        return;
    }
    if (tensor == TENSOR_MASTER) fail("the CPU trainer keeps no master weights");
    if (start < m->par.shard_start || start + n > m->par.shard_start + m->par.shard_count)
        fail("optimizer state range outside this rank's shard");
    float* dst = (tensor == TENSOR_ADAM_M ? m->adam_m : m->adam_v) + (start - m->par.shard_start);
    if (to_host) memcpy(host, dst, n * sizeof(float));
    else memcpy(dst, host, n * sizeof(float));
}

static void cpu_step_begin(void* ctx, int step) {
    CpuModel* m = (CpuModel*)ctx;
    cpu_profile_step_begin(&m->profile, step);
    m->offload.timed = m->profile.active ? &m->profile.host : NULL;
}

static void cpu_step_end(void* ctx, int step) {
    CpuModel* m = (CpuModel*)ctx;
    if (!m->profile.active) return;
    double step_ms = cpu_profile_step_end(&m->profile);
    m->offload.timed = NULL;
    size_t kv_bytes = plan_ring_kv_bytes(&m->plan->spec);
    if (m->par.cp.group_size > 1) cpu_ring_time(&m->ring, &m->par.cp, kv_bytes, &m->profile.ring);
    if (m->rank != 0) return;
    /* the matmul timed from layer 0's ln2 rows into its fch: nothing reads them before the next step writes them */
    BlockTensors w = layer_params(m, 0);
    double half_rows = cpu_time_matmul_half_rows(act(m, 0, ACT_FCH), act(m, 0, ACT_LN2), w.fcw, w.fcb, tile_tokens(m), m->cfg.channels, m->w.fc_width,
                                                 spec_cost_model(&m->plan->spec).matmul_half_rows);
    cpu_calibration_write(&m->profile, &m->plan->spec, step, step_ms, half_rows);
}

static Backend cpu_backend(CpuModel* m) {
    Backend be;
    memset(&be, 0, sizeof(be));
    snprintf(be.device.name, sizeof(be.device.name), "CPU reference (fp32)");
    be.ctx = m;
    be.inputs = m->inputs;
    be.targets = m->targets;
    be.io_chunk = (float*)(m->arena + m->plan->off_io_chunk);
    be.window = m->arena + m->plan->off_loader;
    be.model_file_version = 3;
    be.forward_backward = cpu_forward_backward;
    be.set_dropout = cpu_set_dropout;
    be.set_documents = cpu_set_documents;
    be.doc_start = m->doc_start;
    be.ring_chunks = m->par.ring_chunks;
    be.forward_loss = cpu_forward_loss;
    be.token_losses = cpu_token_losses;
    be.token_top1 = cpu_token_top1;
    be.next_token_probs = cpu_next_token_probs;
    be.zero_grads = cpu_zero_grads;
    be.sync_grads = cpu_sync_grads;
    be.grad_norm = cpu_grad_norm;
    be.update = cpu_update;
    be.transfer = cpu_transfer;
    be.step_begin = cpu_step_begin;
    be.step_end = cpu_step_end;
    cpu_profile_init(&m->profile);
    return be;
}

static void cpu_model_free(CpuModel* m) {
    cpu_ring_free(&m->ring);
    free(m->rope.inv_freq);
    free(m->arena);
    free(m->host_pool);
    rank_parallel_free(&m->par);
    memset(m, 0, sizeof(*m));
}

#ifndef REMAT_NO_MAIN
int main(int argc, char** argv) {
    cpu_threads_wait_policy(argv); /* may execute the trainer again: before anything else */
    proc_init(&argc, &argv);
    char threads_from[300];
    cpu_threads_setup(threads_from, sizeof(threads_from));
    Run run;
    const TrainerTraits cpu_trainer = {FOR_CPU, (int)sizeof(real), (int)sizeof(real), 0, 0, CPU_LOGITS_CHUNK_ROWS};
    run_setup(&run, argc, argv, &cpu_trainer);
    run_print_header(&run);
#ifdef _OPENMP
    printf("threads: %d (OpenMP: %s)\n", omp_get_max_threads(), threads_from);
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
