/*
 * emu/ptx.h: the inline-PTX instructions of llmc/cuda/ptx.cuh for remat's CPU
 * emulator of CUDA (dev/emu; not a GPU). llmc/cuda/ptx.cuh includes this header
 * instead of its asm when it is found on the include path (only the
 * emulator's build puts dev/emu/include there), so kernels are the same
 * source on both.
 *
 * Why it exists: the mma attention kernels (llmc/cuda/attention_mma.cuh) keep
 * tiles in registers in the per-lane fragment layouts the PTX ISA fixes, so
 * their logic is right only if every lane's registers hold exactly the
 * elements the ISA says. Here:
 *   - mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (PTX ISA
 *     "Matrix Fragments for mma.m16n8k16 with floating point type"), with
 *     groupID g = lane >> 2 and t = lane % 4:
 *       A (16x16, 4 registers of 2 elements, low half first): element i of
 *         lane (i = 0..7) is row g + 8 * ((i >> 1) & 1), column 2t + (i & 1)
 *         + 8 * (i >> 2);
 *       B (16x8, 2 registers): element i (0..3) is row (k) 2t + (i & 1) + 8 *
 *         (i >> 1), column (n) g;
 *       C, D (16x8 fp32, 4 registers): element i is row g + 8 * (i >> 1),
 *         column 2t + (i & 1).
 *     D = A*B + C in fp32: each product of two 16-bit values is exact in
 *     float; the sum starts from C and adds k = 0..15 in order, each addition
 *     rounded (tensor cores add in another order: results agree with a GPU's
 *     to rounding, not bitwise).
 *   - ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lanes 8j..8j+7
 *     give the addresses of rows 0..7 of matrix j (16-byte aligned, 16 bytes
 *     each); register j of lane l receives row l / 4, columns 2 (l % 4) and
 *     2 (l % 4) + 1 of matrix j (low half first), or with .trans column l / 4,
 *     rows 2 (l % 4) and 2 (l % 4) + 1.
 *   - cp.async.{ca,cg}.shared.global 16 bytes, cp.async.commit_group,
 *     cp.async.wait_group N, cp.async.wait_all: the source is read at the
 *     call, but the bytes land in shared memory only when the issuing thread
 *     waits for the copy's group, so a missing wait (or a missing barrier
 *     after it, for other threads) reads stale data here as it may on a GPU.
 *     A thread that issues a copy while it still has copies pending from an
 *     earlier block stops the program (a block that never waited).
 * mma and ldmatrix are warp-collective: every lane must reach the same call
 * (emu::warp_collective), with the same instruction form. Every shared-memory
 * access these instructions make goes through ptx_smem_read/ptx_smem_write,
 * which the hazard tracker (racecheck) observes.
 */
#ifndef REMAT_EMU_PTX_H
#define REMAT_EMU_PTX_H

#include <stdint.h>
#include <string.h>

#include "emu.h"
#include "half_types.h"

extern "C" void __tsan_write_range(void* p, unsigned long n); /* runtime/emu_racecheck.cpp */

namespace emu {
namespace ptx {

/* The hazard tracker's view (runtime/emu_racecheck.cpp). ldmatrix runs as
 * lane 0's thread for the whole warp, uninstrumented: its shared-memory rows
 * are reported as read by every lane of the warp, as WMMA's tiles are (no
 * lane's read is ordered against another lane's write by it). A cp.async
 * lands in the issuing thread's own wait_group, whose (instrumented) copy is
 * that thread's write at that moment: the hook only marks the place. */
static inline void ptx_smem_read(const void* p, size_t bytes, const CallSite& where) { race_warp_access(p, 1, bytes, bytes, false, where); }
static inline void ptx_smem_write(void* p, size_t bytes) { (void)p; (void)bytes; }
/* At the issue of a cp.async: on a GPU its bytes may land at any moment
 * until the wait, so the destination counts as written by the issuing thread
 * from then on (a write record, the bytes untouched): another thread's access
 * in the same epoch, e.g. a read of the buffer's previous contents that no
 * barrier separates from the issue, is a hazard. */
static inline void ptx_smem_write_pending(void* p, size_t bytes) { __tsan_write_range(p, (unsigned long)bytes); }

/* The ISA's fragment layouts (the statement above), as (row, column). */
static inline void a_elem(int lane, int i, int* row, int* col) {
    *row = (lane >> 2) + 8 * ((i >> 1) & 1);
    *col = 2 * (lane & 3) + (i & 1) + 8 * (i >> 2);
}
static inline void b_elem(int lane, int i, int* k, int* n) {
    *k = 2 * (lane & 3) + (i & 1) + 8 * (i >> 1);
    *n = lane >> 2;
}
static inline void c_elem(int lane, int i, int* row, int* col) {
    *row = (lane >> 2) + 8 * (i >> 1);
    *col = 2 * (lane & 3) + (i & 1);
}

static inline float b16_to_float(uint16_t bits, bool is_bf16) { return is_bf16 ? bf16_bits_to_float(bits) : half_bits_to_float(bits); }
static inline uint16_t half_of(uint32_t reg, int which) { return (uint16_t)(which ? reg >> 16 : reg & 0xffffu); }

struct MmaArgs {
    float* d;
    const uint32_t* a;
    const uint32_t* b;
    const float* c;
    bool is_bf16;
    CallSite where;
};

static inline void mma_all(void* const lanes[32]) {
    const MmaArgs& a0 = *(const MmaArgs*)lanes[0];
    float A[16][16], B[16][8], Cm[16][8];
    for (int l = 0; l < 32; l++) {
        const MmaArgs& m = *(const MmaArgs*)lanes[l];
        if (m.is_bf16 != a0.is_bf16)
            fatal("mma.sync m16n8k16 (%s:%d): lane %d uses another element type than lane 0", a0.where.file, a0.where.line, l);
        for (int i = 0; i < 8; i++) {
            int r, c;
            a_elem(l, i, &r, &c);
            A[r][c] = b16_to_float(half_of(m.a[i >> 1], i & 1), m.is_bf16);
        }
        for (int i = 0; i < 4; i++) {
            int k, n;
            b_elem(l, i, &k, &n);
            B[k][n] = b16_to_float(half_of(m.b[i >> 1], i & 1), m.is_bf16);
        }
        for (int i = 0; i < 4; i++) {
            int r, c;
            c_elem(l, i, &r, &c);
            Cm[r][c] = m.c[i];
        }
    }
    for (int l = 0; l < 32; l++) { /* all of C was read first: d may be c */
        const MmaArgs& m = *(const MmaArgs*)lanes[l];
        for (int i = 0; i < 4; i++) {
            int r, c;
            c_elem(l, i, &r, &c);
            float s = Cm[r][c];
            for (int k = 0; k < 16; k++) s += A[r][k] * B[k][c];
            m.d[i] = s;
        }
    }
}

static inline void mma(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], bool is_bf16, CallSite where) {
    MmaArgs args{d, a, b, c, is_bf16, where};
    warp_collective(where.line, where.file, "mma.sync.aligned.m16n8k16", mma_all, &args);
}

struct LdmArgs {
    uint32_t* r;
    const void* row;
    int num;
    bool trans;
    CallSite where;
};

__attribute__((no_sanitize_thread)) static inline void ldmatrix_all(void* const lanes[32]) {
    const LdmArgs& a0 = *(const LdmArgs*)lanes[0];
    for (int l = 1; l < 32; l++) {
        const LdmArgs& m = *(const LdmArgs*)lanes[l];
        if (m.num != a0.num || m.trans != a0.trans)
            fatal("ldmatrix (%s:%d): lane %d runs .x%d%s, lane 0 .x%d%s: every lane must run the same form", a0.where.file,
                  a0.where.line, l, m.num, m.trans ? ".trans" : "", a0.num, a0.trans ? ".trans" : "");
    }
    uint16_t M[4][8][8]; /* matrix, row, column */
    for (int j = 0; j < a0.num; j++)
        for (int r = 0; r < 8; r++) {
            const LdmArgs& m = *(const LdmArgs*)lanes[8 * j + r];
            ptx_smem_read(m.row, 16, a0.where);
            memcpy(M[j][r], m.row, 16);
        }
    for (int l = 0; l < 32; l++) {
        const LdmArgs& m = *(const LdmArgs*)lanes[l];
        for (int j = 0; j < a0.num; j++) {
            const int q = l >> 2, e = 2 * (l & 3);
            uint16_t lo = a0.trans ? M[j][e][q] : M[j][q][e];
            uint16_t hi = a0.trans ? M[j][e + 1][q] : M[j][q][e + 1];
            m.r[j] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
}

/* Lanes whose address the instruction reads (x1: 0..7, x2: 0..15, x4: all)
 * must give a 16-byte aligned row inside the block's memory. */
static inline void ldmatrix(uint32_t* r, const void* row, int num, bool trans, CallSite where) {
    const int lane = (int)(cur_thread_idx.x & 31);
    if (lane < 8 * num) {
        if ((uintptr_t)row % 16) fatal("ldmatrix (%s:%d): lane %d's row address %p is not 16-byte aligned", where.file, where.line, lane, row);
        check_kernel_range("ldmatrix", where, row, 16);
    }
    LdmArgs args{r, row, num, trans, where};
    warp_collective(where.line, where.file, "ldmatrix.sync.aligned.m8n8", ldmatrix_all, &args);
}

/* ---- cp.async: per thread, copies pending until their group is waited for ---- */
struct Copy {
    void* dst;
    unsigned char bytes[16];
    uint64_t group; /* the commit count when it was committed; UINT64_MAX while not committed */
};
/* EMU_CP_ASYNC_PENDING: the copies a thread may have pending, the
 * emulator's capacity (PTX states no such limit; a GPU stalls the issue):
 * above the 72 of a one-warp mma dK/dV block (its K and V rows, 4 copies
 * each, and two 32-copy Q/dO tiles), low enough that a kernel that never
 * waits stops within a few tiles. */
#define EMU_CP_ASYNC_PENDING 128
struct ThreadCopies {
    Copy pending[EMU_CP_ASYNC_PENDING];
    int n;
    uint64_t committed; /* groups committed so far */
    uint3 block;        /* the block that issued the pending copies */
    dim3 grid;
};
inline ThreadCopies g_copies[1024];

static inline ThreadCopies& my_copies() {
    const unsigned t = cur_thread_idx.x + cur_block_dim.x * (cur_thread_idx.y + cur_block_dim.y * cur_thread_idx.z);
    return g_copies[t];
}

static inline bool same_block(const ThreadCopies& c) {
    return c.block.x == cur_block_idx.x && c.block.y == cur_block_idx.y && c.block.z == cur_block_idx.z && c.grid.x == cur_grid_dim.x &&
           c.grid.y == cur_grid_dim.y && c.grid.z == cur_grid_dim.z;
}

static inline void cp_async(void* dst, const void* src, CallSite where) {
    if ((uintptr_t)dst % 16 || (uintptr_t)src % 16)
        fatal("cp.async (%s:%d): 16-byte copy from %p to %p: both addresses must be 16-byte aligned", where.file, where.line, src, dst);
    check_kernel_range("cp.async (shared destination)", where, dst, 16);
    check_kernel_range("cp.async (global source)", where, src, 16);
    ThreadCopies& c = my_copies();
    if (c.n && !same_block(c))
        fatal("cp.async (%s:%d): thread %u has %d copies pending from an earlier block (%u,%u,%u): a kernel that never waited for "
              "its cp.async groups",
              where.file, where.line, cur_thread_idx.x, c.n, c.block.x, c.block.y, c.block.z);
    if (!c.n) {
        c.block = cur_block_idx;
        c.grid = cur_grid_dim;
        c.committed = 0;
    }
    if (c.n == EMU_CP_ASYNC_PENDING)
        fatal("cp.async (%s:%d): more than %d copies pending in one thread", where.file, where.line, EMU_CP_ASYNC_PENDING);
    ptx_smem_write_pending(dst, 16);
    Copy& k = c.pending[c.n++];
    k.dst = dst;
    init_read("cp.async (global source)", where, src, 16);
    memcpy(k.bytes, src, 16);
    k.group = UINT64_MAX;
}

static inline void commit_group() {
    ThreadCopies& c = my_copies();
    if (c.n && !same_block(c)) return; /* reported by the next cp.async */
    for (int i = 0; i < c.n; i++)
        if (c.pending[i].group == UINT64_MAX) c.pending[i].group = c.committed;
    c.committed++;
}

/* Lands every copy of a group committed before the newest `allowed_pending`
 * groups; nothing where EMU_DELETE_SYNC names the call (as if deleted). */
static inline void wait_group(int allowed_pending, const CallSite& where) {
    if (call_deleted(where.file, where.line)) return;
    ThreadCopies& c = my_copies();
    if (!c.n || !same_block(c)) return;
    int keep = 0;
    for (int i = 0; i < c.n; i++) {
        Copy& k = c.pending[i];
        if (k.group != UINT64_MAX && k.group + (uint64_t)allowed_pending < c.committed) {
            ptx_smem_write(k.dst, 16);
            memcpy(k.dst, k.bytes, 16);
        } else {
            c.pending[keep++] = k;
        }
    }
    c.n = keep;
}

}  // namespace ptx
}  // namespace emu

#endif
