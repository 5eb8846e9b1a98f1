/*
 * Matmuls through cuBLASLt, forward and backward, and the bias gradient.
 *
 * Shapes (row-major, as in the CPU reference): inp (N,IC), W (OC,IC) stored
 * (out, in), bias (OC), out (N,OC); N = B*T rows.
 *   forward          out  = inp @ W^T + bias [+ resid]
 *   backward input   dinp = dout @ W              (overwritten)
 *   backward weight  dW  += dout^T @ inp,  dbias += column sums of dout
 *
 * Layout mapping. cuBLASLt is column-major. A row-major (R,K) matrix occupies
 * memory exactly like the column-major (K,R) matrix that is its transpose,
 * with leading dimension K. So cuBLASLt sees
 *   Wc = W^T   (IC x OC, ld IC),  Ic = inp^T (IC x N, ld IC),
 *   Oc = out^T (OC x N, ld OC),   dOc = dout^T (OC x N, ld OC), dWc = dW^T (IC x OC, ld IC)
 * and the three products become D(m x n) = op(A)(m x k) op(B)(k x n):
 *   forward:  out^T = W inp^T      -> Oc  = Wc^T Ic    m=OC n=N  k=IC  A=Wc op T, B=Ic op N
 *   dinp:     dinp^T = W^T dout^T  -> dIc = Wc dOc     m=IC n=N  k=OC  A=Wc op N, B=dOc op N
 *   dW:       dW^T += inp^T dout   -> dWc += Ic dOc^T  m=IC n=OC k=N   A=Ic op N, B=dOc op T, beta 1
 *             (C and D fp32 for a gradient accumulated in fp32, as cuBLASLt
 *             allows with 16-bit A and B and CUBLAS_COMPUTE_32F)
 * The bias epilogue adds a vector of length m (rows of D) to every column,
 * which in the forward product is exactly bias (OC) added to every token.
 *
 * Residual fusion: D = op(A) op(B) + bias + beta*C with C the residual
 * stream (beta 1, C != D is allowed by cuBLASLt when C and D share type,
 * shape and order), so "matmul + bias + residual add" is one call, rounded
 * once into floatX.
 *
 * Precision: compute type CUBLAS_COMPUTE_32F in every build, so FP32 builds
 * never use TF32 (no _FAST_ variant is requested), BF16 and FP16 builds
 * (A, B, C, D and bias in CUDA_R_16BF or CUDA_R_16F) accumulate in fp32 and
 * round once into the storage type. Scale type fp32. In FP16 a result beyond
 * 65504 is expected to be stored as inf (round to nearest), which the
 * gradient norm then reports; a kernel that saturated to 65504 instead would
 * hide the overflow (unverified on GPU: test_gpt's overflow check covers it).
 *
 * Determinism: the algorithm for a call is the first heuristic result for its
 * shapes, types, epilogue and operand alignments, cached per key (training
 * uses a few dozen keys; sampling pads its lengths to powers of two so that
 * it adds few), so a given call always runs the same kernel; cuBLASLt kernels are run-to-run
 * deterministic on one stream (split-K reductions go through the workspace or
 * serialise in place). Recompute passes operands of the same shapes and
 * alignments (the plan aligns every buffer to 256 bytes), hence the same
 * algorithm and the same bits. The bias gradient is our own two-stage column
 * sum (no atomics).
 *
 * Status: see the status table in README.md.
 */
#ifndef REMAT_MATMUL_CUH
#define REMAT_MATMUL_CUH

#include "cuda_common.cuh"

#define MATMUL_CACHE_SIZE 256

typedef struct {
    int transa, transb, m, n, k, lda, ldb, ldd;
    int has_bias, has_c, c_is_d;
    int d_fp32; /* C and D in fp32 (a gradient accumulated in fp32), else floatX */
    int align_a, align_b, align_c, align_d, align_bias;
} MatmulKey;

typedef struct {
    MatmulKey key;
    cublasLtMatmulAlgo_t algo;
    int bias_in_epilogue; /* 0: no algorithm takes the bias epilogue here; a kernel adds it */
} MatmulCacheEntry;

typedef struct {
    cublasLtHandle_t handle;
    void* workspace;
    size_t workspace_bytes;
    MatmulCacheEntry cache[MATMUL_CACHE_SIZE];
    int cache_used;
    int fallback_noted, cache_full_noted;
    int align_cap; /* 0, or the most operand alignment cuBLASLt is told of (token tiles: what every tile's rows share) */
} MatmulContext;

static inline void gpu_matmul_init(MatmulContext* mc) {
    memset(mc, 0, sizeof(*mc));
    CUBLAS_CHECK(cublasLtCreate(&mc->handle));
}

/* cuBLASLt's workspace (train_gpt: the plan's library_workspace, 32 MiB, the
 * size the cuBLAS documentation recommends for Hopper, cublasSetWorkspace).
 * The library refuses a workspace that is not 256-byte aligned
 * (CUBLAS_STATUS_INVALID_VALUE at every call): checked once here. Without
 * one (NULL, 0) the heuristic offers only workspace-free algorithms, none at
 * all for some shapes. */
static inline void gpu_matmul_set_workspace(MatmulContext* mc, void* workspace, size_t workspace_bytes) {
    if (workspace_bytes && (!workspace || (uintptr_t)workspace % 256))
        fail("internal: cuBLASLt's workspace (%p, %zu bytes) is not 256-byte aligned", workspace, workspace_bytes);
    mc->workspace = workspace_bytes ? workspace : NULL;
    mc->workspace_bytes = workspace_bytes;
}

static inline void gpu_matmul_destroy(MatmulContext* mc) {
    if (mc->handle) CUBLAS_CHECK(cublasLtDestroy(mc->handle));
    mc->handle = NULL;
}

/* Largest power of two dividing the address, at most 256 (cuBLASLt's default assumption). */
static inline int pointer_alignment(const void* p) {
    uintptr_t a = (uintptr_t)p;
    if (a == 0) return 256;
    uintptr_t low = a & (~a + 1);
    return low >= 256 ? 256 : (int)low;
}

/* The alignment cuBLASLt is told an operand has: its own, at most the cap.
 * Rows r0 of a token tile lie at different alignments in a kept tensor and
 * in a one-tile buffer; the cap (what all tiles' rows share) makes both
 * find the same algorithm, hence the same summation order and bits. */
static inline int lt_alignment(const MatmulContext* mc, const void* p) {
    int a = pointer_alignment(p);
    return mc->align_cap && a > mc->align_cap ? mc->align_cap : a;
}

typedef struct {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c, d;
} LtDescs;

static inline void lt_descs_create(LtDescs* ds, const MatmulKey* key, int bias_epilogue, const void* bias) {
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&ds->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = key->transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key->transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (bias_epilogue) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(ds->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    }
    /* op(A) is m x k: A is stored k x m when transposed; op(B) is k x n: B is stored n x k when transposed. */
    uint64_t m = (uint64_t)key->m, n = (uint64_t)key->n, k = (uint64_t)key->k;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds->a, CUBLAS_FLOATX, key->transa ? k : m, key->transa ? m : k, key->lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds->b, CUBLAS_FLOATX, key->transb ? n : k, key->transb ? k : n, key->ldb));
    cudaDataType cd = key->d_fp32 ? CUDA_R_32F : CUBLAS_FLOATX;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds->c, cd, m, n, key->ldd));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ds->d, cd, m, n, key->ldd));
}

static inline void lt_descs_destroy(LtDescs* ds) {
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(ds->a));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(ds->b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(ds->c));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(ds->d));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(ds->desc));
}

/* The first heuristic result for a key, or 0 when cuBLASLt offers none. */
static inline int lt_find_algo(MatmulContext* mc, const MatmulKey* key, int bias_epilogue, const void* bias,
                               cublasLtMatmulAlgo_t* algo) {
    LtDescs ds;
    lt_descs_create(&ds, key, bias_epilogue, bias);
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = (uint64_t)mc->workspace_bytes;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
    uint32_t al[4] = {(uint32_t)key->align_a, (uint32_t)key->align_b, (uint32_t)key->align_c, (uint32_t)key->align_d};
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], sizeof(al[0])));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], sizeof(al[1])));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], sizeof(al[2])));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[3], sizeof(al[3])));
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof(res));
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(mc->handle, ds.desc, ds.a, ds.b, key->c_is_d ? ds.d : ds.c, ds.d, pref, 1,
                                                       &res, &found);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    lt_descs_destroy(&ds);
    if (st != CUBLAS_STATUS_SUCCESS || found < 1 || res.state != CUBLAS_STATUS_SUCCESS) return 0;
    *algo = res.algo;
    return 1;
}

/* D += bias broadcast over columns: D (m x n, column-major, ld ldd), bias (m). Fallback only. */
__global__ void add_bias_kernel(floatX* D, const floatX* bias, int m, int n, int ldd) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)m * n) return;
    int row = (int)(i % m);
    size_t col = i / m;
    floatX* p = D + col * (size_t)ldd + row;
    *p = from_f32<floatX>(to_f32(*p) + to_f32(bias[row]));
}

/* D (m x n) = op(A) op(B) [+ bias over rows] + beta * C, all column-major;
 * A, B and bias floatX, C and D floatX or (d_fp32) fp32. C may be NULL (then
 * beta must be 0) or equal D (accumulate in place). */
static void lt_matmul(MatmulContext* mc, cudaStream_t stream, int transa, int transb, int m, int n, int k,
                      const floatX* A, int lda, const floatX* B, int ldb, const void* Cin, float beta,
                      void* D, int ldd, const floatX* bias, int d_fp32) {
    if (!Cin) Cin = D;
    if (d_fp32 && bias) fail("internal: no bias epilogue on an fp32 matmul result");
    MatmulKey key;
    memset(&key, 0, sizeof(key));
    key.transa = transa; key.transb = transb; key.m = m; key.n = n; key.k = k;
    key.lda = lda; key.ldb = ldb; key.ldd = ldd;
    key.has_bias = bias != NULL; key.has_c = beta != 0.0f; key.c_is_d = Cin == D; key.d_fp32 = d_fp32;
    key.align_a = lt_alignment(mc, A); key.align_b = lt_alignment(mc, B);
    key.align_c = lt_alignment(mc, Cin); key.align_d = lt_alignment(mc, D);
    key.align_bias = bias ? pointer_alignment(bias) : 0;
    MatmulCacheEntry found;
    int hit = 0;
    for (int i = 0; i < mc->cache_used; i++)
        if (memcmp(&mc->cache[i].key, &key, sizeof(key)) == 0) { found = mc->cache[i]; hit = 1; break; }
    if (!hit) {
        memset(&found, 0, sizeof(found));
        found.key = key;
        /* the bias epilogue wants an aligned bias vector (16 bytes is what
         * other cuBLASLt users found safe); the plan gives 256 */
        found.bias_in_epilogue = key.has_bias && key.align_bias >= 16;
        if (!lt_find_algo(mc, &key, found.bias_in_epilogue, bias, &found.algo)) {
            found.bias_in_epilogue = 0;
            if (!key.has_bias || !lt_find_algo(mc, &key, 0, NULL, &found.algo))
                fail("cuBLASLt offers no algorithm for a %s matmul m=%d n=%d k=%d (transa %d transb %d, alignments %d/%d/%d/%d, "
                     "%s, workspace %zu MiB)",
                     PRECISION_NAME, m, n, k, transa, transb, key.align_a, key.align_b, key.align_c, key.align_d,
                     key.has_bias ? "with and without the bias epilogue" : "no epilogue", mc->workspace_bytes >> 20);
            if (!mc->fallback_noted) {
                printf("note: cuBLASLt has no bias epilogue for some %s matmul shapes; a separate kernel adds those biases\n", PRECISION_NAME);
                mc->fallback_noted = 1;
            }
        }
        if (mc->cache_used < MATMUL_CACHE_SIZE) mc->cache[mc->cache_used++] = found;
        else if (!mc->cache_full_noted) {
            /* entries are never evicted, so training's stay; a key beyond the cache asks the heuristic on every call */
            printf("note: cuBLASLt algorithm cache full (%d shapes); further shapes are looked up on every call\n", MATMUL_CACHE_SIZE);
            mc->cache_full_noted = 1;
        }
    }
    LtDescs ds;
    lt_descs_create(&ds, &key, found.bias_in_epilogue, bias);
    const float alpha = 1.0f;
    /* in place (C == D) passes D's own layout for C, as cuBLASLt asks */
    CUBLAS_CHECK(cublasLtMatmul(mc->handle, ds.desc, &alpha, A, ds.a, B, ds.b, &beta, Cin, key.c_is_d ? ds.d : ds.c, D, ds.d,
                                &found.algo, mc->workspace, mc->workspace_bytes, stream));
    lt_descs_destroy(&ds);
    if (key.has_bias && !found.bias_in_epilogue) {
        add_bias_kernel<<<grid_for((size_t)m * n, 256), 256, 0, stream>>>((floatX*)D, bias, m, n, ldd);
        CUDA_CHECK_LAUNCH();
    }
}

/* out (N,OC) = inp (N,IC) @ W (OC,IC)^T [+ bias (OC)] [+ resid (N,OC)]; out must not alias inp or W. */
static inline void gpu_matmul_forward(MatmulContext* mc, floatX* out, const floatX* inp, const floatX* W, const floatX* bias,
                                      const floatX* resid, int N, int IC, int OC, cudaStream_t stream) {
    lt_matmul(mc, stream, 1, 0, OC, N, IC, W, IC, inp, IC, resid, resid ? 1.0f : 0.0f, out, OC, bias, 0);
}

/* dinp (N,IC) = dout (N,OC) @ W (OC,IC), overwritten. */
static inline void gpu_matmul_backward_input(MatmulContext* mc, floatX* dinp, const floatX* dout, const floatX* W,
                                             int N, int IC, int OC, cudaStream_t stream) {
    lt_matmul(mc, stream, 0, 0, IC, N, OC, W, IC, dout, OC, NULL, 0.0f, dinp, IC, NULL, 0);
}

/* Stage 1 of dbias (OC) += column sums of dout (N,OC): block (32 threads
 * of VEC columns each) x (COLUMN_BLOCK_Y row lanes), grid
 * (ceil(OC/(32 VEC)), COLUMN_SPLITS); writes partials[split * OC + col].
 * VEC = XVEC (16-byte loads of dout) where OC is a multiple of it and dout
 * is 16-byte aligned, else 1. Each column's sum runs over the same rows in
 * the same order at either width. */
template <int VEC>
__global__ void bias_partials_kernel(float* partials, const floatX* dout, int N, int OC) {
    __shared__ float s[COLUMN_BLOCK_Y][32 * VEC];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c0 = (blockIdx.x * 32 + tx) * VEC;
    const int rps = column_rows_per_split(N);
    const int r0 = blockIdx.y * rps, r1 = min(N, r0 + rps);
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
    if (c0 < OC)
        for (int r = r0 + ty; r < r1; r += COLUMN_BLOCK_Y) {
            Vec<floatX, VEC> d = vload<VEC>(dout + (size_t)r * OC + c0);
#pragma unroll
            for (int j = 0; j < VEC; j++) acc[j] += to_f32(d.v[j]);
        }
#pragma unroll
    for (int j = 0; j < VEC; j++) s[ty][tx * VEC + j] = acc[j];
    __syncthreads();
    if (ty == 0 && c0 < OC) {
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float total = 0.0f;
            for (int k = 0; k < COLUMN_BLOCK_Y; k++) total += s[k][tx * VEC + j];
            partials[(size_t)blockIdx.y * OC + c0 + j] = total;
        }
    }
}

/* dbias (OC) += column sums of dout (N,OC); partials: COLUMN_SPLITS*OC floats
 * of scratch. dbias floatX, or fp32 (a token tile's share added to its
 * layer's fp32 sum). */
template <typename G>
static inline void gpu_bias_backward(G* dbias, float* partials, const floatX* dout, int N, int OC, cudaStream_t stream) {
    dim3 block(32, COLUMN_BLOCK_Y);
    if (OC % XVEC == 0 && aligned16(dout)) {
        dim3 grid((unsigned)ceil_div((size_t)OC, 32 * XVEC), COLUMN_SPLITS);
        bias_partials_kernel<XVEC><<<grid, block, 0, stream>>>(partials, dout, N, OC);
    } else {
        dim3 grid((unsigned)ceil_div((size_t)OC, 32), COLUMN_SPLITS);
        bias_partials_kernel<1><<<grid, block, 0, stream>>>(partials, dout, N, OC);
    }
    CUDA_CHECK_LAUNCH();
    gpu_column_finish(dbias, partials, OC, stream);
}

/* dW (OC,IC) += dout^T @ inp; dbias (OC) += column sums of dout when dbias is
 * not NULL (partials: COLUMN_SPLITS*OC floats of scratch). */
static inline void gpu_matmul_backward_weight(MatmulContext* mc, floatX* dW, floatX* dbias, float* partials, const floatX* dout,
                                              const floatX* inp, int N, int IC, int OC, cudaStream_t stream) {
    lt_matmul(mc, stream, 0, 1, IC, OC, N, inp, IC, dout, OC, dW, 1.0f, dW, IC, NULL, 0);
    if (dbias) gpu_bias_backward(dbias, partials, dout, N, OC, stream);
}

/* dW (OC,IC) += dout^T @ inp with dW in fp32, and dbias (OC) += column sums
 * of dout in fp32 when dbias is not NULL: a gradient summed over many calls
 * (the token table's over the logits chunks, a layer's over its token tiles)
 * is rounded to floatX once, at the end, instead of after every call. */
static inline void gpu_matmul_backward_weight_fp32(MatmulContext* mc, float* dW, float* dbias, float* partials, const floatX* dout,
                                                   const floatX* inp, int N, int IC, int OC, cudaStream_t stream) {
    lt_matmul(mc, stream, 0, 1, IC, OC, N, inp, IC, dout, OC, dW, 1.0f, dW, IC, NULL, 1);
    if (dbias) gpu_bias_backward(dbias, partials, dout, N, OC, stream);
}

#endif
