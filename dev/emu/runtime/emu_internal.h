/*
 * emu_internal.h: what the two halves of remat's CUDA emulator runtime
 * (emu_runtime.cpp: threads, memory, streams; emu_cublaslt.cpp: matmuls)
 * share and device code does not see. dev/emu; not a GPU.
 */
#ifndef REMAT_EMU_INTERNAL_H
#define REMAT_EMU_INTERNAL_H

#include "cuda_runtime.h"

namespace emu {

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
