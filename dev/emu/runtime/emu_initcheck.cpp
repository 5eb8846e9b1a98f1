/*
 * emu_initcheck.cpp: uninitialised reads of device memory for remat's CPU
 * emulator of CUDA (dev/emu; not a GPU), the emulator's counterpart of
 * compute-sanitizer's initcheck.
 *
 * Why it exists: memory is filled with NaN bytes when it is allocated (and
 * the trainer's dead buffers when they are registered anew each step), so a
 * read before the first write usually shows as a wrong result, but not when
 * the value read is masked, discarded or overwritten, and the result names
 * no culprit. Here every byte of device memory has a shadow byte, 1 once it
 * has been written; a read of a byte whose shadow is 0 stops the program,
 * naming the reader, the address and the buffer.
 *
 * How: cudaMalloc blocks are mapped inside one reserved address range, and
 * the shadow of address a lies at a + g_dev_len (pages only exist where they
 * are touched). The shadow is 0 for a new block and is cleared again when
 * an NVTX heap or region is registered or unregistered (the trainer renews
 * its dead buffers that way before each forward pass). Kernel stores set it
 * (the instrumented accesses, emu_racecheck.cpp's hook; WMMA tile stores),
 * kernel loads, atomics, WMMA tile loads and cp.async sources check it; so
 * do the host-side operations: copies and memsets set their destination (a
 * device-to-device copy carries its source's shadow along), a
 * device-to-host copy and the cuBLASLt stand-in's operand reads check their
 * source, matmul outputs are set. EMU_INITCHECK=0 turns all of it off (a
 * read of unwritten memory then only reads the NaN bytes).
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <string>

#include "emu_internal.h"

namespace emu {

uintptr_t g_dev_lo = 0, g_dev_len = 0;
bool g_initcheck = true;

namespace {

const size_t DEVICE_SPACE_BYTES = (size_t)4 << 40; /* address space for every cudaMalloc of a run (never reused) */
uintptr_t g_dev_next = 0;

void reserve(void) {
    if (g_dev_lo) return;
    /* the device range, its shadow and the stream shadow (emu_streamcheck.cpp), inaccessible until a block is mapped */
    size_t total = 2 * DEVICE_SPACE_BYTES + stream_shadow_bytes(DEVICE_SPACE_BYTES);
    void* m = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) fatal("initcheck: cannot reserve %zu bytes of address space for device memory and its shadows", total);
    g_dev_lo = g_dev_next = (uintptr_t)m;
    g_dev_len = DEVICE_SPACE_BYTES;
    if (const char* v = getenv("EMU_INITCHECK")) {
        if (strcmp(v, "0") == 0) g_initcheck = false;
        else if (strcmp(v, "1") != 0) fatal("EMU_INITCHECK=%s: expected 0 (off) or 1 (on, the default)", v);
    }
}

void map_fixed(uintptr_t at, size_t len, int prot) {
    if (mmap((void*)at, len, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED)
        fatal("initcheck: cannot map %zu bytes of device memory at %p", len, (void*)at);
}

}  // namespace

char* device_map(size_t len) {
    reserve();
    if (len > g_dev_lo + g_dev_len - g_dev_next) return nullptr;
    uintptr_t at = g_dev_next;
    g_dev_next += len;
    map_fixed(at, len, PROT_READ | PROT_WRITE);
    map_fixed(at + g_dev_len, len, PROT_READ | PROT_WRITE); /* zero: nothing written yet */
    map_fixed(stream_shadow_at(at), stream_shadow_bytes(len), PROT_READ | PROT_WRITE); /* zero: no stream touched it */
    return (char*)at;
}

void device_unmap(char* map, size_t len) {
    map_fixed((uintptr_t)map, len, PROT_NONE);
    map_fixed((uintptr_t)map + g_dev_len, len, PROT_NONE);
    map_fixed(stream_shadow_at((uintptr_t)map), stream_shadow_bytes(len), PROT_NONE);
}

void init_set(const void* p, size_t n, bool written) {
    if (g_initcheck && n && is_device_address((uintptr_t)p)) memset(init_shadow((uintptr_t)p), written ? 1 : 0, n);
}

const void* init_first_unwritten(const void* p, size_t n) {
    if (!g_initcheck || !n || !is_device_address((uintptr_t)p)) return nullptr;
    const unsigned char* s = init_shadow((uintptr_t)p);
    const void* z = memchr(s, 0, n);
    return z ? (const unsigned char*)p + ((const unsigned char*)z - s) : nullptr;
}

void init_fail(const std::string& reader, const void* p, size_t n, const void* unwritten) {
    std::string what = describe_device_byte((uintptr_t)unwritten);
    fatal("initcheck: uninitialised read of %zu bytes at %p by %s: %s was not written since its allocation or the (re-)registration "
          "of its NVTX region (on a GPU it holds whatever was there before)",
          n, p, reader.c_str(), what.c_str());
}

void init_check(const char* reader, const void* p, size_t n) {
    if (const void* u = init_first_unwritten(p, n)) init_fail(reader, p, n, u);
}

void init_copy(const char* api, void* dst, const void* src, size_t n) {
    bool from_device = is_device_address((uintptr_t)src), to_device = is_device_address((uintptr_t)dst);
    if (from_device && !to_device) init_check(api, src, n);
    stream_access(src, n, false);
    stream_access(dst, n, true);
    memcpy(dst, src, n);
    if (to_device && g_initcheck) {
        if (from_device) memcpy(init_shadow((uintptr_t)dst), init_shadow((uintptr_t)src), n);
        else memset(init_shadow((uintptr_t)dst), 1, n);
    }
}

void init_kernel_fault(uintptr_t a, size_t n, void* pc) {
    if (g_cur < 0) return; /* not a CUDA thread */
    init_fail("a load at " + describe_pc(pc, true), (const void*)a, n, init_first_unwritten((const void*)a, n));
}

void init_warp_access(uintptr_t a, size_t rows, size_t row_bytes, size_t stride_bytes, bool write, const CallSite& where) {
    for (size_t r = 0; r < rows && g_initcheck; r++) {
        const void* row = (const void*)(a + r * stride_bytes);
        if (write) init_set(row, row_bytes, true);
        else if (const void* u = init_first_unwritten(row, row_bytes))
            init_fail("the WMMA tile load at " + std::string(where.file) + ":" + std::to_string(where.line) + " (tile row " +
                          std::to_string(r) + ")",
                      row, row_bytes, u);
    }
}

}  // namespace emu

/* cp.async's global source (include/emu/ptx.h) */
void emu::init_read(const char* api, const CallSite& where, const void* p, size_t n) {
    stream_access(p, n, false);
    if (const void* u = init_first_unwritten(p, n))
        init_fail(std::string(api) + " at " + where.file + ":" + std::to_string(where.line), p, n, u);
}
