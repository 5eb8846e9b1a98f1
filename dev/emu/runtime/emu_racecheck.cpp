/*
 * emu_racecheck.cpp: shared-memory hazard detection for remat's CPU emulator
 * of CUDA (dev/emu; not a GPU), the emulator's counterpart of
 * compute-sanitizer's racecheck and part of its synccheck.
 *
 * Why it exists: the emulator runs a warp's lanes one after another and a
 * block's warps one after another, so a missing __syncwarp() or
 * __syncthreads() rarely changes a result here although it is a race on a
 * GPU. Instead of hoping that a run order exposes it, every access to shared
 * memory is checked against the last accesses to the same byte.
 *
 * How: the transformed CUDA sources are compiled with GCC's
 * -fsanitize=thread instrumentation, which calls __tsan_readN/__tsan_writeN
 * (defined here, instead of ThreadSanitizer's runtime) before every memory
 * access that survives optimisation. Accesses outside a kernel or outside
 * shared memory return after one comparison. For each byte of shared memory
 * a shadow keeps the last write and the reads since it: who (one thread, a
 * whole warp for WMMA, several lanes of one warp, several warps), the block
 * epoch (advanced by every __syncthreads and at every new block) and the
 * warp epoch (advanced by the warp's __syncwarp) at the time, and where. Two
 * accesses are ordered when they are by the same thread, when a
 * __syncthreads came between them, or when both are in one warp and a
 * __syncwarp of that warp came between them; shuffles, votes and WMMA
 * operations order nothing. A write unordered with an earlier read or write
 * by another thread, or a read unordered with an earlier write by another
 * thread, stops the program naming the hazard, the address, the shared
 * object, both threads and both source lines.
 */
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>

#include "emu_internal.h"

extern char __bss_start[], _end[]; /* every static __shared__ object (and the dynamic buffer) lies in .bss */

namespace emu {

namespace {

/* One access record. who: WHO_NONE, WHO_THREAD | tid, WHO_WARP | warp (a
 * WMMA operation, or several lanes of one warp), WHO_WARPS (several warps).
 * at: a code address (low 48 bits) and the first thread + 1 (high 16), or,
 * with SITE set in who, a source file (low 48) and line (high 16). */
enum : uint16_t { WHO_NONE = 0, WHO_THREAD = 0x1000, WHO_WARP = 0x2000, WHO_WARPS = 0x3000, WHO_KIND = 0xf000, SITE = 0x0800 };
struct Rec {
    uint32_t bep;
    uint16_t wep;
    uint16_t who;
    uint64_t at;
};
struct Shadow {
    Rec w, r;
};

uintptr_t g_lo = 0, g_len = 0;      /* .bss, watched while a kernel runs (g_len 0 otherwise) */
uintptr_t g_bss_len = 0;
Shadow* g_shadow = nullptr;         /* one per byte of .bss */
unsigned char* g_tracked = nullptr; /* 1 for bytes of shared memory */
uint32_t g_bep = 1;
uint16_t g_wep[32];

inline int rec_warp(const Rec& r) {
    uint16_t k = r.who & WHO_KIND;
    return k == WHO_THREAD ? (r.who & 0x3ff) / 32 : k == WHO_WARP ? (r.who & 0x3f) : -1;
}

/* Is r ordered before an access by a thread of warp `warp` now? */
inline bool ordered(const Rec& r, int warp) {
    if (r.bep != g_bep) return true;
    return rec_warp(r) == warp && r.wep != g_wep[warp];
}

inline bool same_thread(const Rec& r, uint16_t who) { return (r.who & WHO_KIND) == WHO_THREAD && (r.who & ~SITE) == (who & ~SITE); }

}  // namespace

std::string describe_pc(void* code, bool inline_chain) {
    char buf[600];
    uintptr_t pc = (uintptr_t)code;
    Dl_info info;
    uintptr_t off = pc;
    if (dladdr((void*)pc, &info) && info.dli_fbase) off = pc - (uintptr_t)info.dli_fbase;
    /* the line table (-g1) names the source line; addr2line is part of binutils, beside the compiler */
    snprintf(buf, sizeof(buf), "addr2line -e /proc/%d/exe -C -i -f -p 0x%lx 2>/dev/null", (int)getpid(), (unsigned long)(off - 1));
    std::string line;
    if (FILE* p = popen(buf, "r")) {
        char out[600];
        while (fgets(out, sizeof(out), p) && (line.empty() || inline_chain)) {
            if (!line.empty() && out[0] != ' ') line += " ";
            line += out;
            while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
        }
        pclose(p);
    }
    if (line.empty() || line.find("??") != std::string::npos) {
        snprintf(buf, sizeof(buf), "code address %p", (void*)pc);
        return buf;
    }
    return line;
}

namespace {

std::string describe_at(const Rec& r) {
    if (r.who & SITE) {
        char buf[600];
        snprintf(buf, sizeof(buf), "%s:%u", (const char*)(uintptr_t)(r.at & 0xffffffffffffull), (unsigned)(r.at >> 48));
        return buf;
    }
    return describe_pc((void*)(uintptr_t)(r.at & 0xffffffffffffull));
}

std::string describe_who(const Rec& r) {
    char buf[200];
    switch (r.who & WHO_KIND) {
    case WHO_THREAD: {
        int t = r.who & 0x3ff;
        snprintf(buf, sizeof(buf), "thread %d (warp %d, lane %d)", t, t / 32, t % 32);
        break;
    }
    case WHO_WARP:
        if (r.who & SITE) snprintf(buf, sizeof(buf), "every lane of warp %d (a WMMA operation)", r.who & 0x3f);
        else snprintf(buf, sizeof(buf), "several lanes of warp %d (the first: thread %d)", r.who & 0x3f, (int)(r.at >> 48) - 1);
        break;
    default:
        if (r.who & SITE) snprintf(buf, sizeof(buf), "threads of several warps");
        else snprintf(buf, sizeof(buf), "threads of several warps (the first: thread %d)", (int)(r.at >> 48) - 1);
        break;
    }
    return buf;
}

[[noreturn]] void report(const char* hazard, uintptr_t a, const Rec& earlier, const char* earlier_did, const Rec& now,
                         const char* now_does) {
    std::string obj = describe_shared(a);
    std::string e_who = describe_who(earlier), e_at = describe_at(earlier), n_who = describe_who(now), n_at = describe_at(now);
    fatal("racecheck: %s hazard on shared memory at %p (%s): %s %s at %s and %s %s at %s with no __syncwarp() or __syncthreads() "
          "between them that orders the two (a race on a GPU)",
          hazard, (void*)a, obj.c_str(), e_who.c_str(), earlier_did, e_at.c_str(), n_who.c_str(), now_does, n_at.c_str());
}

/* One access of n bytes at a by `who` (a thread, or a warp for WMMA) of warp `warp`. */
void access(uintptr_t a, size_t n, bool write, uint16_t who, int warp, uint64_t at) {
    Rec now{g_bep, g_wep[warp], who, at};
    for (size_t i = 0; i < n; i++) {
        uintptr_t off = a + i - g_lo;
        if (off >= g_bss_len || !g_tracked[off]) continue;
        Shadow& s = g_shadow[off];
        if (s.w.who && !ordered(s.w, warp) && !same_thread(s.w, who))
            report(write ? "write-after-write" : "read-after-write", a + i, s.w, "wrote it", now, write ? "writes it" : "reads it");
        if (write) {
            if (s.r.who && !ordered(s.r, warp) && !same_thread(s.r, who))
                report("write-after-read", a + i, s.r, "read it", now, "writes it");
            s.w = now;
            s.r.who = WHO_NONE;
        } else if (!s.r.who || ordered(s.r, warp)) {
            s.r = now;
        } else if (!same_thread(s.r, who)) {
            /* several readers in one epoch: keep the first's site */
            s.r.who = (uint16_t)((s.r.who & SITE) | (rec_warp(s.r) == warp ? WHO_WARP | warp : WHO_WARPS));
            s.r.wep = g_wep[warp];
        }
    }
}

/* Every instrumented access: shared memory is checked for hazards, NVTX
 * heaps for guard zones, device memory for reads of bytes never written
 * (emu_initcheck.cpp); nothing else while a kernel runs, nothing at all
 * otherwise (g_len is 0 then). */
inline void hook(const void* p, size_t n, bool write, void* pc) {
    uintptr_t a = (uintptr_t)p;
    if (!g_len) return;
    if (a - g_lo < g_len) {
        int t = g_cur;
        if (t >= 0) access(a, n, write, (uint16_t)(WHO_THREAD | t), t / 32, (uint64_t)(uintptr_t)pc | ((uint64_t)(t + 1) << 48));
        return;
    }
    if (!is_device_address(a)) return;
    for (int i = 0; i < g_num_guarded; i++) {
        const GuardedHeap& h = g_guarded[i];
        uintptr_t off = a - h.lo;
        if (off >= h.size) continue;
        for (size_t j = 0; j < n && off + j < h.size; j++)
            if (h.guard[off + j]) guard_access(a, n, write, pc);
        break;
    }
    if (g_initcheck) init_kernel_access(a, n, write, pc);
    if (g_stream_check) stream_access(p, n, write);
}

}  // namespace

void race_init(void) {
    if (g_shadow) return;
    g_lo = (uintptr_t)__bss_start;
    g_bss_len = (uintptr_t)_end - g_lo;
    size_t bytes = g_bss_len * sizeof(Shadow);
    void* s = mmap(nullptr, bytes + g_bss_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s == MAP_FAILED) fatal("racecheck: cannot map the %zu-byte shadow of .bss", bytes);
    g_shadow = (Shadow*)s;
    g_tracked = (unsigned char*)s + bytes;
}

void race_track(const void* p, size_t bytes) {
    uintptr_t off = (uintptr_t)p - g_lo;
    if (off >= g_bss_len || bytes > g_bss_len - off) fatal("racecheck: shared memory at %p (%zu bytes) outside .bss", p, bytes);
    memset(g_tracked + off, 1, bytes);
}

void race_kernel(bool running) { g_len = running ? g_bss_len : 0; }

void race_block_epoch(void) {
    g_bep++;
    memset(g_wep, 0, sizeof(g_wep));
}

void race_warp_epoch(int warp) { g_wep[warp]++; }

void race_warp_access(const void* p, size_t rows, size_t row_bytes, size_t stride_bytes, bool write, const CallSite& where) {
    uintptr_t a = (uintptr_t)p;
    if (is_device_address(a)) {
        init_warp_access(a, rows, row_bytes, stride_bytes, write, where);
        for (size_t r = 0; r < rows && g_stream_check; r++) stream_access((const void*)(a + r * stride_bytes), row_bytes, write);
        return;
    }
    if (a - g_lo >= g_len || g_cur < 0) return;
    int warp = g_cur / 32;
    uint64_t at = (uint64_t)(uintptr_t)where.file | ((uint64_t)(uint16_t)where.line << 48);
    for (size_t r = 0; r < rows; r++)
        access(a + r * stride_bytes, row_bytes, write, (uint16_t)(WHO_WARP | SITE | warp), warp, at);
}

}  // namespace emu

/* ---- what -fsanitize=thread code calls (GCC's ThreadSanitizer ABI) ---- */
extern "C" {
#define EMU_TSAN_RW(n)                                                                                      \
    void __tsan_read##n(void* p) { emu::hook(p, n, false, __builtin_return_address(0)); }                  \
    void __tsan_write##n(void* p) { emu::hook(p, n, true, __builtin_return_address(0)); }                  \
    void __tsan_unaligned_read##n(void* p) { emu::hook(p, n, false, __builtin_return_address(0)); }        \
    void __tsan_unaligned_write##n(void* p) { emu::hook(p, n, true, __builtin_return_address(0)); }        \
    void __tsan_volatile_read##n(void* p) { emu::hook(p, n, false, __builtin_return_address(0)); }         \
    void __tsan_volatile_write##n(void* p) { emu::hook(p, n, true, __builtin_return_address(0)); }
EMU_TSAN_RW(1)
EMU_TSAN_RW(2)
EMU_TSAN_RW(4)
EMU_TSAN_RW(8)
EMU_TSAN_RW(16)
#undef EMU_TSAN_RW
void __tsan_read_range(void* p, unsigned long n) { emu::hook(p, n, false, __builtin_return_address(0)); }
void __tsan_write_range(void* p, unsigned long n) { emu::hook(p, n, true, __builtin_return_address(0)); }
/* Atomics (guard variables of function-local statics, mostly): done here,
 * unchecked; device atomics are plain read-modify-writes (emu.h). */
#define EMU_TSAN_ATOMIC(n, T)                                                                          \
    T __tsan_atomic##n##_load(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
    void __tsan_atomic##n##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); }
EMU_TSAN_ATOMIC(8, uint8_t)
EMU_TSAN_ATOMIC(16, uint16_t)
EMU_TSAN_ATOMIC(32, uint32_t)
EMU_TSAN_ATOMIC(64, uint64_t)
#undef EMU_TSAN_ATOMIC
void __tsan_init(void) {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit(void) {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
}
