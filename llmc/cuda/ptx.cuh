/*
 * Thin device-function wrappers for the inline PTX the mma attention kernels
 * use (sm_80+): mma.sync m16n8k16 (bf16/f16 in, fp32 accumulate), ldmatrix
 * x1/x2/x4 (.trans) and cp.async 16-byte copies with commit/wait groups.
 *
 * Why a wrapper: inline asm cannot run on the host, and the kernels must run
 * under the CPU emulator (dev/emu) too. Each wrapper holds its asm under
 * __CUDA_ARCH__; when dev/emu/include is on the include path (the emulator's
 * build only) the same names come from emu/ptx.h instead, which implements
 * the instructions with the ISA's per-lane fragment layouts. Register
 * fragments are uint32_t arrays holding two 16-bit elements each (the lower
 * column or row in the low half), as the ISA states them; that layout is
 * documented in dev/emu/include/emu/ptx.h.
 *
 * Status (sm_80, sm_90): see the status table in README.md.
 */
#ifndef REMAT_PTX_CUH
#define REMAT_PTX_CUH

#include <stdint.h>
#include "cuda_common.cuh"

#if __has_include(<emu/ptx.h>)
#include <emu/ptx.h>
#define PTX_SITE , emu::CallSite where = {__builtin_LINE(), __builtin_FILE()}
#define PTX_SITE_ONLY emu::CallSite where = {__builtin_LINE(), __builtin_FILE()}
#define PTX_EMULATED 1
#else
#define PTX_SITE
#define PTX_SITE_ONLY
#define PTX_EMULATED 0
#endif

/* True for bf16 floatX, false for fp16: the mma's input type. */
#define PTX_FLOATX_IS_BF16 (PRECISION_IS_BF16)

#if !PTX_EMULATED && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "llmc/cuda/ptx.cuh: mma.sync m16n8k16, ldmatrix and cp.async need sm_80 or newer"
#endif

/* Shared-memory address of a generic pointer, as ldmatrix and cp.async take it. */
__device__ __forceinline__ uint32_t ptx_smem_addr(const void* p) {
#if defined(__CUDA_ARCH__)
    return (uint32_t)__cvta_generic_to_shared(p);
#else
    (void)p;
    return 0;
#endif
}

/* d = a * b + c, one 16x8x16 tile product of the warp; T is floatX (bf16 or fp16). */
__device__ __forceinline__ void ptx_mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4] PTX_SITE) {
#if PTX_EMULATED
    emu::ptx::mma(d, a, b, c, PTX_FLOATX_IS_BF16, where);
#elif defined(__CUDA_ARCH__)
#if PTX_FLOATX_IS_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
#else
    (void)d; (void)a; (void)b; (void)c;
#endif
}

/* ldmatrix .x4 / .x2 / .x1 (NUM matrices), TRANS for .trans: lane l passes the
 * address of row l % 8 of matrix l / 8 (16-byte aligned shared memory). */
template <int NUM, bool TRANS> __device__ __forceinline__ void ptx_ldmatrix(uint32_t r[NUM], const void* row PTX_SITE) {
    static_assert(NUM == 1 || NUM == 2 || NUM == 4, "ldmatrix loads 1, 2 or 4 matrices");
#if PTX_EMULATED
    emu::ptx::ldmatrix(r, row, NUM, TRANS, where);
#elif defined(__CUDA_ARCH__)
    const uint32_t a = ptx_smem_addr(row);
    if constexpr (NUM == 4 && TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else if constexpr (NUM == 4)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else if constexpr (NUM == 2 && TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    else if constexpr (NUM == 2)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    else if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
#else
    (void)r; (void)row;
#endif
}

/* 16 bytes global -> shared, asynchronous; CG: bypass L1 (.cg), else .ca.
 * Lands only by the issuing thread's ptx_cp_async_wait for its group. */
template <bool CG> __device__ __forceinline__ void ptx_cp_async16(void* smem, const void* gmem PTX_SITE) {
#if PTX_EMULATED
    emu::ptx::cp_async(smem, gmem, where);
#elif defined(__CUDA_ARCH__)
    if constexpr (CG)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(ptx_smem_addr(smem)), "l"(gmem) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(ptx_smem_addr(smem)), "l"(gmem) : "memory");
#else
    (void)smem; (void)gmem;
#endif
}

__device__ __forceinline__ void ptx_cp_async_commit() {
#if PTX_EMULATED
    emu::ptx::commit_group();
#elif defined(__CUDA_ARCH__)
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/* Waits until at most N of this thread's committed groups are pending. */
template <int N> __device__ __forceinline__ void ptx_cp_async_wait(PTX_SITE_ONLY) {
#if PTX_EMULATED
    emu::ptx::wait_group(N, where);
#elif defined(__CUDA_ARCH__)
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* Two floats as the two 16-bit halves of one fragment register (lo first). */
__device__ __forceinline__ uint32_t ptx_pack2(float lo, float hi) {
    floatX l = from_f32<floatX>(lo), h = from_f32<floatX>(hi);
    uint16_t a, b;
    memcpy(&a, &l, 2);
    memcpy(&b, &h, 2);
    return (uint32_t)a | ((uint32_t)b << 16);
}

#endif
