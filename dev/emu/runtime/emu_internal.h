/*
 * emu_internal.h: what the two halves of remat's CUDA emulator runtime
 * (emu_runtime.cpp: threads, memory, streams; emu_cublaslt.cpp: matmuls)
 * share and device code does not see. dev/emu; not a GPU.
 */
#ifndef REMAT_EMU_INTERNAL_H
#define REMAT_EMU_INTERNAL_H

#include <string.h>

#include <string>
#include <vector>
#include <functional>

#include "cuda_runtime.h"

namespace emu {

/* The running CUDA thread (its index in the block), -1 outside a kernel. */
extern int g_cur;
/* "byte N of the M-byte __shared__ object at P" for an address in this launch's shared memory. */
std::string describe_shared(uintptr_t a);

/* Racecheck (emu_racecheck.cpp), driven by the scheduler: race_init maps the
 * shadow (once), race_track marks shared memory, race_kernel(true/false)
 * brackets a kernel's run, race_block_epoch is a new block or a completed
 * __syncthreads, race_warp_epoch a completed __syncwarp of that warp. */
void race_init(void);
void race_track(const void* p, size_t bytes);
void race_kernel(bool running);
void race_block_epoch(void);
void race_warp_epoch(int warp);
/* "function at file:line" of a code address (addr2line on the line table), or the address;
 * with inline_chain, the functions it is inlined into follow ("(inlined by) ..."). */
std::string describe_pc(void* pc, bool inline_chain = false);

/* Memcheck of NVTX sub-allocator heaps (emu_memcheck.cpp). g_guarded: the
 * heaps and their guard maps (1 for a byte outside every region), read by
 * the access hook. guard_access stops the program if a kernel's access
 * touches a guard byte; check_region_range if a range that starts in a
 * region leaves it; check_guard_canaries if a guard byte was overwritten.
 * forget_heaps: heaps inside a freed block. */
struct GuardedHeap {
    uintptr_t lo;
    size_t size;
    const unsigned char* guard;
};
const int MAX_GUARDED_HEAPS = 8;
extern GuardedHeap g_guarded[MAX_GUARDED_HEAPS];
extern int g_num_guarded;
void guard_access(uintptr_t a, size_t n, bool write, void* pc);
void check_region_range(const char* api, const char* operand, const void* p, size_t bytes);
void check_guard_canaries(const char* after_what);
void forget_heaps(uintptr_t lo, uintptr_t hi);

/* "byte N of buffer 'x' (S bytes at P) in heap 'h'" for an address in an NVTX region, else "". */
std::string describe_region_byte(uintptr_t a);

/* Initcheck (emu_initcheck.cpp). Device memory (cudaMalloc) lies in
 * g_dev_lo .. g_dev_lo+g_dev_len; the shadow byte of address a, at
 * a + g_dev_len, is 1 once a was written. device_map maps len bytes there
 * (unwritten), device_unmap makes them inaccessible. init_set marks bytes
 * written (copies, memsets, matmul outputs) or unwritten (NVTX
 * registration); init_check stops the program if `reader` reads a byte of
 * p .. p+n nobody wrote; init_copy is a memcpy that checks a device source
 * copied to the host and carries a device source's shadow along (a host
 * source's bytes count as written). init_kernel_access is the hook's part
 * for an instrumented kernel access; init_warp_access that of a WMMA tile. */
extern uintptr_t g_dev_lo, g_dev_len;
extern bool g_initcheck; /* false with EMU_INITCHECK=0: nothing is checked or recorded */
inline bool is_device_address(uintptr_t a) { return a - g_dev_lo < g_dev_len; }
inline unsigned char* init_shadow(uintptr_t a) { return (unsigned char*)(a + g_dev_len); }
char* device_map(size_t len);
void device_unmap(char* map, size_t len);
void init_set(const void* p, size_t n, bool written);
const void* init_first_unwritten(const void* p, size_t n);
[[noreturn]] void init_fail(const std::string& reader, const void* p, size_t n, const void* unwritten);
void init_check(const char* reader, const void* p, size_t n);
void init_copy(const char* api, void* dst, const void* src, size_t n);
void init_kernel_fault(uintptr_t a, size_t n, void* pc);
void init_warp_access(uintptr_t a, size_t rows, size_t row_bytes, size_t stride_bytes, bool write, const CallSite& where);
/* "byte N of buffer ..." (describe_region_byte) or "byte N of the S-byte cudaMalloc block at P". */
std::string describe_device_byte(uintptr_t a);

inline bool all_written(const unsigned char* s, size_t n) {
    const uint64_t ONES = 0x0101010101010101ull;
    uint64_t x, y;
    uint32_t v4;
    uint16_t v2;
    switch (n) {
    case 1: return s[0];
    case 2: memcpy(&v2, s, 2); return v2 == 0x0101;
    case 4: memcpy(&v4, s, 4); return v4 == 0x01010101u;
    case 8: memcpy(&x, s, 8); return x == ONES;
    case 16: memcpy(&x, s, 8); memcpy(&y, s + 8, 8); return (x & y) == ONES; /* shadow bytes are 0 or 1 */
    }
    return !memchr(s, 0, n);
}

inline void init_kernel_access(uintptr_t a, size_t n, bool write, void* pc) {
    unsigned char* s = init_shadow(a);
    if (write) memset(s, 1, n);
    else if (!all_written(s, n)) init_kernel_fault(a, n, pc);
}

/* Streamcheck (emu_streamcheck.cpp): hazards between streams. g_stream_check
 * is set once a second stream exists. The runtime brackets each operation a
 * stream runs with stream_op_begin (its stream, epoch, the stream's vector
 * clock, a description; returns the op's id) or stream_op_resume (an NCCL
 * call finishing) and stream_op_end; stream_access checks and records a
 * device range the running operation reads or writes. The shadow of device
 * address a (8 bytes per byte) lies at stream_shadow_at(a). */
extern bool g_stream_check;
inline size_t stream_shadow_bytes(size_t device_bytes) { return 8 * device_bytes; }
inline uintptr_t stream_shadow_at(uintptr_t a) { return g_dev_lo + 2 * g_dev_len + 8 * (a - g_dev_lo); }
uint32_t stream_op_begin(int stream, uint32_t epoch, const std::vector<uint32_t>* clock, std::string what);
void stream_op_resume(uint32_t id, int stream, const std::vector<uint32_t>* clock);
void stream_op_end(void);
void stream_access(const void* p, size_t n, bool write);
/* "the legacy default stream", "stream 2 (cudaStreamNonBlocking, priority -5)" (emu_runtime.cpp) */
std::string stream_name(int stream);

/* p .. p+bytes must lie inside one cudaMalloc allocation; otherwise fatal,
 * naming the API and operand. */
void check_device_range(const char* api, const char* operand, const void* p, size_t bytes);
/* Stream handle check (NULL is the default stream). */
void check_stream(const char* api, cudaStream_t stream);
/* Called after every queued operation: writes into the slack after an
 * allocation's end (up to its 256-byte rounding) are reported here. */
void check_canaries(const char* after_what);
/* Runs everything queued on every stream (waiting for peers' NCCL calls if
 * one is pending). */
void flush(void);
/* Runs what can run without waiting for another process; true if anything
 * is still queued. */
bool progress(void);
/* An operation that finishes later (an NCCL call): start() runs when it
 * reaches the head of its stream, then poll() until it returns true; the
 * stream runs nothing else meanwhile. Accesses go through stream_access in
 * both (the op is resumed around poll). */
void enqueue_async(cudaStream_t stream, std::string what, std::function<void()> start, std::function<bool()> poll);
/* enqueue with a description for streamcheck's messages */
void enqueue_named(cudaStream_t stream, std::string what, std::function<void()> run);
/* The index of a stream handle (0: the legacy default stream). */
int stream_index(const char* api, cudaStream_t stream);
/* What is running now, for messages ("kernel X launched at f:l", "cublasLtMatmul"). */
void set_activity(const char* what);

}  // namespace emu

#endif
