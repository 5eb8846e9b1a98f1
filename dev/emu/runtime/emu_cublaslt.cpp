/*
 * emu_cublaslt.cpp: cuBLASLt matmuls for remat's CPU emulator of CUDA
 * (dev/emu). NOT a GPU and not cuBLASLt: the documented semantics only.
 *
 * Why it exists: the trainer's matmuls (forward with bias and residual
 * epilogues, the two backward products, the classifier) are cuBLASLt calls;
 * emulating them lets the surrounding code (layouts, leading dimensions,
 * transposes, in-place accumulation, algorithm caching keyed on shapes and
 * alignments) be tested on a CPU. What is computed, per the cuBLASLt
 * documentation:
 *   D = alpha * op(A) op(B) + beta * C  [+ bias[i] on every column with CUBLASLT_EPILOGUE_BIAS]
 * column-major, op(X) = X or X^T, compute type CUBLAS_COMPUTE_32F with an
 * fp32 scale type: products and sums in fp32, rounded once to D's type
 * (round to nearest even; an fp16 result beyond 65504 becomes inf). C is not
 * read when beta == 0. The summation order depends on the algorithm, as the
 * real library's does (tiling, split-K): one of 12 orders (SumOrder), chosen
 * by a hash of the problem (shapes, transposes, leading dimensions, types,
 * epilogue) and the alignments the algorithm was found for (or, without an
 * algorithm, the pointers' alignments). So a forward and a recompute that do
 * not run the identical configuration differ bitwise here too (unless their
 * hashes happen to pick the same order, 1 in 12), while the same
 * configuration always gives the same bits, as the trainer's bitwise
 * recompute claim relies on for the real library. The real orders differ
 * from these: results agree with a GPU's to rounding, not bitwise.
 *
 * Checks (fatal, naming the API and argument): descriptor attributes and
 * values outside what is implemented; type combinations the documentation
 * does not list for CUBLAS_COMPUTE_32F; inconsistent shapes; ld < rows;
 * C == D with a different layout, and D overlapping A, B or (partially) C;
 * an algorithm that did not come from cublasLtMatmulAlgoGetHeuristic, or
 * came from it for another problem, or for larger operand alignments than
 * the pointers now have; operands, bias and workspace outside cudaMalloc
 * memory. The heuristic returns exactly one algorithm (which algorithms the
 * real library offers cannot be emulated), needing no workspace, or none,
 * as the real library may for a shape (returnedAlgoCount 0,
 * CUBLAS_STATUS_NOT_SUPPORTED), to exercise callers' fallbacks:
 *   EMU_LT_NO_BIAS_EPILOGUE=1   none with the bias epilogue;
 *   EMU_LT_NO_ALGO=SPEC[,SPEC]  none for the problems SPEC names: MxNxK (D is
 *                               m x n, k the inner size) or "all", with
 *                               ":bias" for the bias epilogue only;
 *   EMU_LT_WORKSPACE=BYTES      every algorithm needs BYTES of workspace, so
 *                               none is offered under a smaller
 *                               CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES.
 * cublasLtMatmul returns CUBLAS_STATUS_INVALID_VALUE, with an "emu:" line on
 * stderr, for a workspace the library refuses: not 256-byte aligned, NULL
 * with a size, or smaller than its algorithm needs.
 * Matmuls are queued on the stream like kernels; descriptors and scalars are
 * read at the call, as by the library.
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cublasLt.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "emu_internal.h"

using emu::fatal;

struct EmuLtContext {
    uint64_t magic;
};
struct EmuLtMatmulDesc {
    cublasComputeType_t compute;
    cudaDataType scale;
    int transa, transb;
    int epilogue;
    const void* bias;
    int bias_type; /* -1: D's type (the documented default) */
};
struct EmuLtMatrixLayout {
    cudaDataType type;
    uint64_t rows, cols;
    int64_t ld;
};
struct EmuLtPreference {
    uint64_t max_workspace;
    uint32_t align[4]; /* A, B, C, D; documented default 256 */
};

namespace {

const uint64_t HANDLE_MAGIC = 0x454d554c54484e44ull; /* "EMULTHND" */
const uint64_t ALGO_MAGIC = 0x454d55414c474f31ull;   /* "EMUALGO1" */

const char* type_name(int t) {
    switch (t) {
    case CUDA_R_32F: return "CUDA_R_32F";
    case CUDA_R_16F: return "CUDA_R_16F";
    case CUDA_R_16BF: return "CUDA_R_16BF";
    case CUDA_R_64F: return "CUDA_R_64F";
    }
    return "an unsupported cudaDataType";
}

size_t type_size(const char* api, int t) {
    switch (t) {
    case CUDA_R_32F: return 4;
    case CUDA_R_16F: return 2;
    case CUDA_R_16BF: return 2;
    }
    fatal("%s: data type %s (%d) is not emulated (CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF are)", api, type_name(t), t);
}

void check_handle(const char* api, cublasLtHandle_t h) {
    if (!h || h->magic != HANDLE_MAGIC) fatal("%s: handle %p is not from cublasLtCreate (or was destroyed)", api, (void*)h);
}

template <typename T> void check_size(const char* api, const char* attr, size_t size) {
    if (size != sizeof(T)) fatal("%s(%s): buffer of %zu bytes, the attribute's type has %zu", api, attr, size, sizeof(T));
}

/* The problem a matmul (or heuristic query) describes, checked. */
struct Problem {
    uint64_t m, n, k;
    int transa, transb, epilogue, bias_type;
    EmuLtMatrixLayout a, b, c, d;
    bool c_is_d_layout;
};

Problem make_problem(const char* api, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                     cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D) {
    if (!desc || !A || !B || !C || !D) fatal("%s: a NULL descriptor", api);
    Problem p;
    p.a = *A; p.b = *B; p.c = *C; p.d = *D;
    p.c_is_d_layout = C->type == D->type && C->rows == D->rows && C->cols == D->cols && C->ld == D->ld;
    p.transa = desc->transa;
    p.transb = desc->transb;
    p.epilogue = desc->epilogue;
    p.m = D->rows;
    p.n = D->cols;
    p.k = p.transa ? A->rows : A->cols;
    uint64_t am = p.transa ? A->cols : A->rows;
    uint64_t bk = p.transb ? B->cols : B->rows, bn = p.transb ? B->rows : B->cols;
    if (am != p.m || bk != p.k || bn != p.n || C->rows != p.m || C->cols != p.n)
        fatal("%s: inconsistent shapes: D is %llu x %llu, op(A) %llu x %llu (A %llu x %llu, %s), op(B) %llu x %llu (B %llu x %llu, %s), C %llu x %llu",
              api, (unsigned long long)p.m, (unsigned long long)p.n, (unsigned long long)am, (unsigned long long)p.k,
              (unsigned long long)A->rows, (unsigned long long)A->cols, p.transa ? "T" : "N", (unsigned long long)bk,
              (unsigned long long)bn, (unsigned long long)B->rows, (unsigned long long)B->cols, p.transb ? "T" : "N",
              (unsigned long long)C->rows, (unsigned long long)C->cols);
    /* CUBLAS_COMPUTE_32F with scale CUDA_R_32F: A and B of one type; C and D of one type, A's or (for 16-bit A/B) CUDA_R_32F */
    bool ab16 = A->type == CUDA_R_16F || A->type == CUDA_R_16BF;
    if (A->type != B->type || C->type != D->type || !(D->type == A->type || (ab16 && D->type == CUDA_R_32F)))
        fatal("%s: type combination A %s, B %s, C %s, D %s is not one cuBLASLt documents for CUBLAS_COMPUTE_32F (or not emulated)", api,
              type_name(A->type), type_name(B->type), type_name(C->type), type_name(D->type));
    p.bias_type = desc->bias_type < 0 ? D->type : desc->bias_type;
    if (p.epilogue == CUBLASLT_EPILOGUE_BIAS && p.bias_type != D->type && !(ab16 && p.bias_type == A->type))
        fatal("%s: bias type %s with D %s is not emulated", api, type_name(p.bias_type), type_name(D->type));
    return p;
}

uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
}

uint64_t problem_hash(const Problem& p) {
    uint64_t h = 0;
    for (uint64_t v : {p.m, p.n, p.k, (uint64_t)p.transa, (uint64_t)p.transb, (uint64_t)p.epilogue, (uint64_t)p.bias_type,
                       (uint64_t)p.a.type, (uint64_t)p.c.type, (uint64_t)p.a.ld, (uint64_t)p.b.ld, (uint64_t)p.c.ld, (uint64_t)p.d.ld})
        h = mix(h, v);
    return h;
}

std::string problem_text(const Problem& p) {
    char buf[300];
    snprintf(buf, sizeof(buf), "m=%llu n=%llu k=%llu trans %s%s, lda %lld ldb %lld ldc %lld ldd %lld, %s -> %s, epilogue %d",
             (unsigned long long)p.m, (unsigned long long)p.n, (unsigned long long)p.k, p.transa ? "T" : "N", p.transb ? "T" : "N",
             (long long)p.a.ld, (long long)p.b.ld, (long long)p.c.ld, (long long)p.d.ld, type_name(p.a.type), type_name(p.d.type),
             p.epilogue);
    return buf;
}

size_t extent_bytes(const EmuLtMatrixLayout& l) { return ((size_t)l.ld * (l.cols - 1) + l.rows) * type_size("cublasLtMatmul", l.type); }

int alignment_of(const void* p) {
    uintptr_t a = (uintptr_t)p;
    if (!a) return 256;
    uintptr_t low = a & (~a + 1);
    return low >= 256 ? 256 : (int)low;
}

bool overlap(const void* a, size_t an, const void* b, size_t bn) {
    return (uintptr_t)a < (uintptr_t)b + bn && (uintptr_t)b < (uintptr_t)a + an;
}

inline float load(const void* p, int type, size_t i) {
    switch (type) {
    case CUDA_R_32F: return ((const float*)p)[i];
    case CUDA_R_16F: return __half2float(((const __half*)p)[i]);
    default: return __bfloat162float(((const __nv_bfloat16*)p)[i]);
    }
}

inline void store(void* p, int type, size_t i, float v) {
    switch (type) {
    case CUDA_R_32F: ((float*)p)[i] = v; break;
    case CUDA_R_16F: ((__half*)p)[i] = __float2half_rn(v); break;
    default: ((__nv_bfloat16*)p)[i] = __float2bfloat16_rn(v); break;
    }
}

typedef float v8f __attribute__((vector_size(32)));

/* The summation order of one algorithm, as a real library's differs from
 * algorithm to algorithm (tiling, split-K): k is cut into `splits` slices of
 * whole 8-element groups; each slice sums into eight interleaved partial sums,
 * combined pairwise (combine 0), left to right (1) or right to left (2); the
 * slices' sums are added in order. */
struct SumOrder {
    int splits, combine;
};
const int SUM_ORDERS = 12;
SumOrder sum_order(uint64_t key) { return SumOrder{1 + (int)(key % 4), (int)(key / 4 % 3)}; }

/* The order an algorithm found for problem p with operand alignments align[4] uses. */
uint64_t order_key(const Problem& p, const uint32_t align[4]) {
    uint64_t h = problem_hash(p);
    for (int i = 0; i < 4; i++) h = mix(h, align[i]);
    return h % SUM_ORDERS;
}

inline float combine8(const v8f& acc, int how) {
    float s[8];
    memcpy(s, &acc, sizeof(s));
    if (how == 0) return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    float r = how == 1 ? s[0] : s[7];
    for (int i = 1; i < 8; i++) r += s[how == 1 ? i : 7 - i];
    return r;
}

/* k8 is a multiple of 8; both rows are zero-padded to it. */
inline float dot8(const float* a, const float* b, size_t k8, SumOrder o) {
    const size_t groups = k8 / 8, per = (groups + o.splits - 1) / o.splits;
    float total = 0.0f;
    for (size_t g0 = 0; g0 < groups; g0 += per) {
        v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
        for (size_t g = g0; g < std::min(groups, g0 + per); g++) {
            v8f x, y;
            memcpy(&x, a + 8 * g, sizeof(x));
            memcpy(&y, b + 8 * g, sizeof(y));
            acc += x * y;
        }
        total = g0 == 0 ? combine8(acc, o.combine) : total + combine8(acc, o.combine);
    }
    return total;
}

/* Initcheck: the elements of matrix l at p (each column's rows, not the rows up to ld) were written; or mark them written. */
void check_matrix_written(const std::string& what, const char* operand, const void* p, const EmuLtMatrixLayout& l) {
    const size_t es = type_size("cublasLtMatmul", l.type), col_bytes = l.rows * es;
    for (uint64_t j = 0; j < l.cols; j++) {
        const char* col = (const char*)p + j * (size_t)l.ld * es;
        if (const void* u = emu::init_first_unwritten(col, col_bytes))
            emu::init_fail(what + ", " + operand + " column " + std::to_string(j), col, col_bytes, u);
    }
}

void set_matrix_written(void* p, const EmuLtMatrixLayout& l) {
    const size_t es = type_size("cublasLtMatmul", l.type);
    for (uint64_t j = 0; j < l.cols; j++) emu::init_set((char*)p + j * (size_t)l.ld * es, l.rows * es, true);
}

void compute(const Problem& p, SumOrder order, float alpha, float beta, const void* A, const void* B, const void* C, void* D,
             const void* bias) {
    const size_t m = p.m, n = p.n, k = p.k, k8 = (k + 7) / 8 * 8;
    std::vector<float> at(m * k8, 0.0f), bt(n * k8, 0.0f);
    /* at: row i = op(A)[i][:], bt: row j = op(B)[:][j] */
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < m; i++)
        for (size_t q = 0; q < k; q++)
            at[i * k8 + q] = load(A, p.a.type, p.transa ? q + i * (size_t)p.a.ld : i + q * (size_t)p.a.ld);
#pragma omp parallel for schedule(static)
    for (size_t j = 0; j < n; j++)
        for (size_t q = 0; q < k; q++)
            bt[j * k8 + q] = load(B, p.b.type, p.transb ? j + q * (size_t)p.b.ld : q + j * (size_t)p.b.ld);
    const bool with_bias = p.epilogue == CUBLASLT_EPILOGUE_BIAS;
#pragma omp parallel for schedule(static)
    for (size_t j = 0; j < n; j++) {
        for (size_t i = 0; i < m; i++) {
            float acc = alpha * dot8(&at[i * k8], &bt[j * k8], k8, order);
            if (beta != 0.0f) acc += beta * load(C, p.c.type, i + j * (size_t)p.c.ld);
            if (with_bias) acc += load(bias, p.bias_type, i);
            store(D, p.d.type, i + j * (size_t)p.d.ld, acc);
        }
    }
}

}  // namespace

const char* cublasGetStatusName(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_(other)";
    }
}
const char* cublasGetStatusString(cublasStatus_t s) { return cublasGetStatusName(s); }

size_t cublasLtGetVersion(void) { return 0; }

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) return CUBLAS_STATUS_NOT_INITIALIZED;
    *handle = new EmuLtContext{HANDLE_MAGIC};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    check_handle("cublasLtDestroy", handle);
    emu::flush();
    handle->magic = 0;
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute, cudaDataType_t scale) {
    if (compute != CUBLAS_COMPUTE_32F)
        fatal("cublasLtMatmulDescCreate: compute type %d is not emulated (only CUBLAS_COMPUTE_32F)", (int)compute);
    if (scale != CUDA_R_32F) fatal("cublasLtMatmulDescCreate: scale type %s with CUBLAS_COMPUTE_32F (cuBLASLt requires CUDA_R_32F)", type_name(scale));
    *desc = new EmuLtMatmulDesc{compute, scale, 0, 0, CUBLASLT_EPILOGUE_DEFAULT, nullptr, -1};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    delete desc;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const void* buf, size_t size) {
    const char* api = "cublasLtMatmulDescSetAttribute";
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
    case CUBLASLT_MATMUL_DESC_TRANSB: {
        const char* name = attr == CUBLASLT_MATMUL_DESC_TRANSA ? "CUBLASLT_MATMUL_DESC_TRANSA" : "CUBLASLT_MATMUL_DESC_TRANSB";
        check_size<int32_t>(api, name, size);
        int32_t v;
        memcpy(&v, buf, 4);
        if (v != CUBLAS_OP_N && v != CUBLAS_OP_T) fatal("%s(%s): operation %d is not emulated (CUBLAS_OP_N, CUBLAS_OP_T are)", api, name, v);
        (attr == CUBLASLT_MATMUL_DESC_TRANSA ? d->transa : d->transb) = v == CUBLAS_OP_T;
        break;
    }
    case CUBLASLT_MATMUL_DESC_EPILOGUE: {
        check_size<uint32_t>(api, "CUBLASLT_MATMUL_DESC_EPILOGUE", size);
        uint32_t v;
        memcpy(&v, buf, 4);
        if (v != CUBLASLT_EPILOGUE_DEFAULT && v != CUBLASLT_EPILOGUE_BIAS)
            fatal("%s(CUBLASLT_MATMUL_DESC_EPILOGUE): epilogue %u is not emulated (DEFAULT and BIAS are)", api, v);
        d->epilogue = (int)v;
        break;
    }
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        check_size<void*>(api, "CUBLASLT_MATMUL_DESC_BIAS_POINTER", size);
        memcpy(&d->bias, buf, sizeof(void*));
        break;
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: {
        check_size<int32_t>(api, "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE", size);
        int32_t v;
        memcpy(&v, buf, 4);
        if (v != -1) type_size(api, v);
        d->bias_type = v;
        break;
    }
    default: fatal("%s: attribute %d is not emulated", api, (int)attr);
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld) {
    const char* api = "cublasLtMatrixLayoutCreate";
    type_size(api, type);
    if (rows == 0 || cols == 0) fatal("%s: an empty %llu x %llu matrix is not emulated", api, (unsigned long long)rows, (unsigned long long)cols);
    if (ld < 0 || (uint64_t)ld < rows)
        fatal("%s: ld %lld < rows %llu (column-major layouts need ld >= rows)", api, (long long)ld, (unsigned long long)rows);
    *layout = new EmuLtMatrixLayout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    delete layout;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t, cublasLtMatrixLayoutAttribute_t attr, const void*, size_t) {
    fatal("cublasLtMatrixLayoutSetAttribute: attribute %d is not emulated (layouts are column-major, unbatched)", (int)attr);
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
    *pref = new EmuLtPreference{0, {256, 256, 256, 256}};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    delete pref;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
    const char* api = "cublasLtMatmulPreferenceSetAttribute";
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
        check_size<uint64_t>(api, "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES", size);
        memcpy(&pref->max_workspace, buf, 8);
        break;
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: {
        check_size<uint32_t>(api, "CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES", size);
        uint32_t v;
        memcpy(&v, buf, 4);
        if (v == 0 || (v & (v - 1))) fatal("%s: alignment %u is not a power of two", api, v);
        pref->align[attr - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES] = v;
        break;
    }
    default: fatal("%s: attribute %d is not emulated", api, (int)attr);
    }
    return CUBLAS_STATUS_SUCCESS;
}

/* EMU_LT_NO_ALGO names this problem (see the header). */
static bool no_algo_for(const Problem& p) {
    const char* env = getenv("EMU_LT_NO_ALGO");
    if (!env || !*env) return false;
    std::string all(env);
    size_t pos = 0;
    while (pos <= all.size()) {
        size_t end = all.find(',', pos);
        if (end == std::string::npos) end = all.size();
        std::string spec = all.substr(pos, end - pos);
        pos = end + 1;
        bool bias_only = false;
        size_t colon = spec.find(':');
        if (colon != std::string::npos) {
            if (spec.substr(colon) != ":bias") fatal("EMU_LT_NO_ALGO=%s: '%s' is not MxNxK[:bias] or all[:bias]", env, spec.c_str());
            bias_only = true;
            spec = spec.substr(0, colon);
        }
        unsigned long long m = 0, n = 0, k = 0;
        char tail = 0;
        bool shape = spec == "all" || sscanf(spec.c_str(), "%llux%llux%llu%c", &m, &n, &k, &tail) == 3;
        if (!shape) fatal("EMU_LT_NO_ALGO=%s: '%s' is not MxNxK[:bias] or all[:bias]", env, spec.c_str());
        if (bias_only && p.epilogue != CUBLASLT_EPILOGUE_BIAS) continue;
        if (spec == "all" || (p.m == m && p.n == n && p.k == k)) return true;
    }
    return false;
}

/* EMU_LT_WORKSPACE: the workspace bytes every algorithm needs (0 unset). */
static uint64_t algo_workspace_bytes() {
    const char* env = getenv("EMU_LT_WORKSPACE");
    if (!env || !*env) return 0;
    char* end = nullptr;
    unsigned long long v = strtoull(env, &end, 10);
    if (!end || *end) fatal("EMU_LT_WORKSPACE=%s: expected a number of bytes", env);
    return v;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t A,
                                              cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                              cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t* results,
                                              int* returned) {
    const char* api = "cublasLtMatmulAlgoGetHeuristic";
    check_handle(api, handle);
    if (!pref || requested < 1 || !results || !returned) fatal("%s: NULL preference or results, or %d algorithms requested", api, requested);
    Problem p = make_problem(api, desc, A, B, C, D);
    memset(results, 0, sizeof(results[0]) * (size_t)requested);
    /* EMU_LT_NO_BIAS_EPILOGUE=1: offer no algorithm with the bias epilogue, as the real library may for some
     * shapes (documented: no result, CUBLAS_STATUS_NOT_SUPPORTED), so the callers' fallback runs */
    static const bool no_bias = getenv("EMU_LT_NO_BIAS_EPILOGUE") && atoi(getenv("EMU_LT_NO_BIAS_EPILOGUE"));
    const uint64_t need = algo_workspace_bytes();
    if ((no_bias && p.epilogue == CUBLASLT_EPILOGUE_BIAS) || no_algo_for(p) || need > pref->max_workspace) {
        *returned = 0;
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    cublasLtMatmulAlgo_t& algo = results[0].algo;
    algo.data[0] = ALGO_MAGIC;
    algo.data[1] = problem_hash(p);
    algo.data[2] = ((uint64_t)pref->align[0] << 32) | pref->align[1];
    algo.data[3] = ((uint64_t)pref->align[2] << 32) | pref->align[3];
    algo.data[4] = order_key(p, pref->align);
    algo.data[5] = need;
    results[0].workspaceSize = need;
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A, cublasLtMatrixLayout_t Adesc,
                              const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc,
                              void* D, cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
    const char* api = "cublasLtMatmul";
    check_handle(api, handle);
    emu::check_stream(api, stream);
    Problem p = make_problem(api, desc, Adesc, Bdesc, Cdesc, Ddesc);
    if (!alpha || !beta) fatal("%s: NULL alpha or beta", api);
    float al, be;
    memcpy(&al, alpha, 4); /* scale type CUDA_R_32F, host pointer mode */
    memcpy(&be, beta, 4);
    std::string what = std::string(api) + " (" + problem_text(p) + ")";
    /* without an algorithm the library chooses one for the pointers' alignments */
    const uint32_t ptr_align[4] = {(uint32_t)alignment_of(A), (uint32_t)alignment_of(B), (uint32_t)alignment_of(C),
                                   (uint32_t)alignment_of(D)};
    const SumOrder order = sum_order(algo ? algo->data[4] : order_key(p, ptr_align));
    if (algo) {
        if (algo->data[0] != ALGO_MAGIC) fatal("%s: the algorithm did not come from cublasLtMatmulAlgoGetHeuristic", what.c_str());
        if (algo->data[1] != problem_hash(p))
            fatal("%s: the algorithm was found for a different problem (shape, transposes, leading dimensions, types or epilogue)",
                  what.c_str());
        const void* ptrs[4] = {A, B, C, D};
        const char* names[4] = {"A", "B", "C", "D"};
        uint32_t need[4] = {(uint32_t)(algo->data[2] >> 32), (uint32_t)algo->data[2], (uint32_t)(algo->data[3] >> 32), (uint32_t)algo->data[3]};
        for (int i = 0; i < 4; i++)
            if ((uint32_t)alignment_of(ptrs[i]) < need[i])
                fatal("%s: %s (%p) is %d-byte aligned, but the algorithm was found for a minimum alignment of %u bytes", what.c_str(),
                      names[i], ptrs[i], alignment_of(ptrs[i]), need[i]);
    }
    size_t an = extent_bytes(p.a), bn = extent_bytes(p.b), cn = extent_bytes(p.c), dn = extent_bytes(p.d);
    emu::check_device_range(what.c_str(), "A", A, an);
    emu::check_device_range(what.c_str(), "B", B, bn);
    emu::check_device_range(what.c_str(), "D", D, dn);
    if (be != 0.0f) emu::check_device_range(what.c_str(), "C", C, cn);
    if (C == D && !p.c_is_d_layout) fatal("%s: C == D (in place) needs Cdesc identical to Ddesc", what.c_str());
    if (overlap(D, dn, A, an) || overlap(D, dn, B, bn)) fatal("%s: D overlaps A or B", what.c_str());
    if (be != 0.0f && C != D && overlap(D, dn, C, cn)) fatal("%s: D partly overlaps C (only C == D is allowed)", what.c_str());
    const void* bias = nullptr;
    if (p.epilogue == CUBLASLT_EPILOGUE_BIAS) {
        bias = desc->bias;
        if (!bias) fatal("%s: CUBLASLT_EPILOGUE_BIAS without CUBLASLT_MATMUL_DESC_BIAS_POINTER", what.c_str());
        size_t bb = p.m * type_size(api, p.bias_type);
        emu::check_device_range(what.c_str(), "the bias", bias, bb);
        if (overlap(D, dn, bias, bb)) fatal("%s: D overlaps the bias", what.c_str());
    }
    /* the library's own refusals (a status, not a crash): cuBLAS asks for a 256-byte aligned workspace of at
     * least what the algorithm needs */
    const uint64_t need = algo ? algo->data[5] : 0;
    const char* refusal = workspace_bytes && !workspace ? "a NULL workspace with a nonzero size"
                          : workspace_bytes && (uintptr_t)workspace % 256 ? "a workspace not 256-byte aligned"
                          : workspace_bytes < need ? "a workspace smaller than the algorithm needs" : nullptr;
    if (refusal) {
        fprintf(stderr, "emu: %s: CUBLAS_STATUS_INVALID_VALUE: %s (%p, %zu bytes; the algorithm needs %llu)\n", what.c_str(), refusal, workspace,
                workspace_bytes, (unsigned long long)need);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (workspace_bytes) emu::check_device_range(what.c_str(), "the workspace", workspace, workspace_bytes);
    size_t bias_bytes = bias ? p.m * type_size(api, p.bias_type) : 0;
    emu::enqueue_named(stream, what, [p, order, al, be, A, B, C, D, an, bn, cn, dn, bias, bias_bytes, what]() {
        emu::set_activity(what.c_str());
        emu::stream_access(A, an, false); /* the spans (columns at ld): the operands' bytes and what lies between */
        emu::stream_access(B, bn, false);
        if (be != 0.0f) emu::stream_access(C, cn, false);
        if (bias) emu::stream_access(bias, bias_bytes, false);
        emu::stream_access(D, dn, true);
        check_matrix_written(what, "A", A, p.a);
        check_matrix_written(what, "B", B, p.b);
        if (be != 0.0f) check_matrix_written(what, "C", C, p.c);
        if (bias) emu::init_check((what + ", the bias").c_str(), bias, p.m * type_size("cublasLtMatmul", p.bias_type));
        compute(p, order, al, be, A, B, C, D, bias);
        set_matrix_written(D, p.d);
        emu::set_activity(nullptr);
        emu::check_canaries(what.c_str());
    });
    return CUBLAS_STATUS_SUCCESS;
}
