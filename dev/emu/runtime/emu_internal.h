/*
 * emu_internal.h: what the two halves of remat's CUDA emulator runtime
 * (emu_runtime.cpp: threads, memory, streams; emu_cublaslt.cpp: matmuls)
 * share and device code does not see. dev/emu; not a GPU.
 */
#ifndef REMAT_EMU_INTERNAL_H
#define REMAT_EMU_INTERNAL_H

#include <string>

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
/* "function at file:line" of a code address (addr2line on the line table), or the address. */
std::string describe_pc(void* pc);

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

/* p .. p+bytes must lie inside one cudaMalloc allocation; otherwise fatal,
 * naming the API and operand. */
void check_device_range(const char* api, const char* operand, const void* p, size_t bytes);
/* Stream handle check (NULL is the default stream). */
void check_stream(const char* api, cudaStream_t stream);
/* Called after every queued operation: writes into the slack after an
 * allocation's end (up to its 256-byte rounding) are reported here. */
void check_canaries(const char* after_what);
/* Runs everything queued (all streams: the emulator keeps one in-order queue). */
void flush(void);
/* What is running now, for messages ("kernel X launched at f:l", "cublasLtMatmul"). */
void set_activity(const char* what);

}  // namespace emu

#endif
