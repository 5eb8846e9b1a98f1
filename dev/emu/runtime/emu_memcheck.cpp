/*
 * emu_memcheck.cpp: per-buffer bounds inside one cudaMalloc for remat's CPU
 * emulator of CUDA (dev/emu; not a GPU), through the NVTX memory-region API
 * (include/nvtx3/nvToolsExtMem.h), as compute-sanitizer's memcheck uses it.
 *
 * Why it exists: the trainer carves one cudaMalloc into all its buffers, so
 * a kernel running one element past a buffer stays inside valid memory. The
 * trainer registers the block as a sub-allocator heap and each buffer as a
 * region (llmc/cuda/nvtx_regions.cuh); the heap's bytes outside every region are
 * then guard zones:
 *   - any kernel access to a guard byte stops the program at once, naming
 *     the access (read or write, size, source line), the region it ran out
 *     of and by how many bytes (every access is instrumented; see
 *     emu_racecheck.cpp);
 *   - WMMA tiles, cuBLASLt operands, copies and memsets that start in a
 *     region must end in it;
 *   - guard bytes hold a canary, checked after every kernel and matmul, for
 *     writes the instrumentation cannot see.
 */
#include <algorithm>
#include <string>
#include <vector>

#include <nvtx3/nvToolsExtMem.h>

#include "emu_internal.h"

namespace emu {

GuardedHeap g_guarded[MAX_GUARDED_HEAPS];
int g_num_guarded = 0;

namespace {

const unsigned char GUARD_CANARY = 0xa7;

struct Region {
    uintptr_t lo;
    size_t size;
    std::string name;
};
struct Heap {
    uintptr_t lo;
    size_t size;
    std::string name;
    std::vector<Region> regions; /* sorted by lo */
    std::vector<unsigned char> guard; /* 1 for bytes outside every region */
    std::vector<std::pair<uintptr_t, size_t>> gaps; /* the guard zones, for the canary check */
};
std::vector<Heap*> g_heaps;

void publish(void) {
    if (g_heaps.size() > (size_t)MAX_GUARDED_HEAPS) fatal("nvtxMemHeapRegister: more than %d heaps are not emulated", MAX_GUARDED_HEAPS);
    g_num_guarded = 0;
    for (Heap* h : g_heaps) g_guarded[g_num_guarded++] = GuardedHeap{h->lo, h->size, h->guard.data()};
}

Heap* heap_of(uintptr_t a) {
    for (Heap* h : g_heaps)
        if (a - h->lo < h->size) return h;
    return nullptr;
}

/* The region holding a, or null. */
const Region* region_of(const Heap* h, uintptr_t a) {
    auto it = std::upper_bound(h->regions.begin(), h->regions.end(), a, [](uintptr_t v, const Region& r) { return v < r.lo; });
    if (it == h->regions.begin()) return nullptr;
    --it;
    return a - it->lo < it->size ? &*it : nullptr;
}

/* "N bytes past the end of region 'x' (S bytes at P)" for a guard byte. */
std::string describe_guard(const Heap* h, uintptr_t a) {
    char buf[300];
    const Region* before = nullptr;
    const Region* after = nullptr;
    for (const Region& r : h->regions) {
        if (r.lo + r.size <= a) before = &r;
        else if (r.lo > a && !after) after = &r;
    }
    if (before && (!after || a - (before->lo + before->size) <= after->lo - a))
        snprintf(buf, sizeof(buf), "%zu bytes past the end of buffer '%s' (%zu bytes at %p)", (size_t)(a - before->lo - before->size) + 1,
                 before->name.c_str(), before->size, (void*)before->lo);
    else if (after)
        snprintf(buf, sizeof(buf), "%zu bytes before buffer '%s' (%zu bytes at %p)", (size_t)(after->lo - a), after->name.c_str(),
                 after->size, (void*)after->lo);
    else snprintf(buf, sizeof(buf), "in heap '%s', which has no regions", h->name.c_str());
    return buf;
}

void find_gaps(Heap* h) {
    h->gaps.clear();
    uintptr_t at = h->lo;
    for (const Region& r : h->regions) {
        if (r.lo > at) h->gaps.push_back({at, r.lo - at});
        at = r.lo + r.size;
    }
    if (at < h->lo + h->size) h->gaps.push_back({at, h->lo + h->size - at});
}

}  // namespace

void guard_access(uintptr_t a, size_t n, bool write, void* pc) {
    for (size_t i = 0; i < n; i++) {
        Heap* h = heap_of(a + i);
        if (!h || !h->guard[a + i - h->lo]) continue;
        if (g_cur < 0) return; /* host code (an OpenMP worker of the CPU reference, say) */
        std::string where = describe_pc(pc), what = describe_guard(h, a + i);
        fatal("memcheck: invalid %s of %zu bytes at %p at %s: a guard zone of heap '%s', %s", write ? "write" : "read", n, (void*)a,
              where.c_str(), h->name.c_str(), what.c_str());
    }
}

void check_region_range(const char* api, const char* operand, const void* p, size_t bytes) {
    uintptr_t a = (uintptr_t)p;
    Heap* h = heap_of(a);
    if (!h || !bytes) return;
    const Region* r = region_of(h, a);
    if (!r) fatal("%s: %s (%zu bytes at %p) starts in a guard zone of heap '%s', %s", api, operand, bytes, p, h->name.c_str(),
                  describe_guard(h, a).c_str());
    if (a + bytes > r->lo + r->size)
        fatal("%s: %s (%zu bytes at %p) runs %zu bytes past the end of buffer '%s' (%zu bytes at %p) in heap '%s'", api, operand, bytes, p,
              (size_t)(a + bytes - r->lo - r->size), r->name.c_str(), r->size, (void*)r->lo, h->name.c_str());
}

std::string describe_region_byte(uintptr_t a) {
    const Heap* h = heap_of(a);
    const Region* r = h ? region_of(h, a) : nullptr;
    if (!r) return "";
    char buf[400];
    snprintf(buf, sizeof(buf), "byte %zu of buffer '%s' (%zu bytes at %p) in heap '%s'", (size_t)(a - r->lo), r->name.c_str(), r->size,
             (void*)r->lo, h->name.c_str());
    return buf;
}

void check_guard_canaries(const char* after_what) {
    for (const Heap* h : g_heaps)
        for (auto& g : h->gaps)
            for (size_t i = 0; i < g.second; i++)
                if (((const unsigned char*)g.first)[i] != GUARD_CANARY)
                    fatal("memcheck: %s wrote into a guard zone of heap '%s' at %p, %s", after_what, h->name.c_str(), (void*)(g.first + i),
                          describe_guard(h, g.first + i).c_str());
}

void forget_heaps(uintptr_t lo, uintptr_t hi) {
    for (size_t i = 0; i < g_heaps.size();)
        if (g_heaps[i]->lo >= lo && g_heaps[i]->lo < hi) {
            delete g_heaps[i];
            g_heaps.erase(g_heaps.begin() + (long)i);
        } else i++;
    publish();
}

}  // namespace emu

using namespace emu;

struct nvtxDomainRegistration_st {
    std::string name;
};

nvtxDomainHandle_t nvtxDomainCreateA(const char* name) { return new nvtxDomainRegistration_st{name ? name : ""}; }

nvtxMemHeapHandle_t nvtxMemHeapRegister(nvtxDomainHandle_t, nvtxMemHeapDesc_t const* d) {
    const char* api = "nvtxMemHeapRegister";
    if (!d || d->extCompatID != NVTX_EXT_COMPATID_MEM || d->usage != NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR ||
        d->type != NVTX_MEM_TYPE_VIRTUAL_ADDRESS || d->typeSpecificDescSize != sizeof(nvtxMemVirtualRangeDesc_t))
        fatal("%s: only a sub-allocator heap of one virtual-address range is emulated", api);
    const nvtxMemVirtualRangeDesc_t* r = (const nvtxMemVirtualRangeDesc_t*)d->typeSpecificDesc;
    check_device_range(api, "the heap", r->ptr, r->size);
    flush(); /* what is queued ran on the memory before it became a heap */
    Heap* h = new Heap{(uintptr_t)r->ptr, r->size, d->messageType == NVTX_MESSAGE_TYPE_ASCII && d->message.ascii ? d->message.ascii : "?", {},
                       std::vector<unsigned char>(r->size, 1), {{(uintptr_t)r->ptr, r->size}}};
    if (heap_of(h->lo)) fatal("%s: %zu bytes at %p overlap a heap registered before", api, r->size, r->ptr);
    memset((void*)h->lo, GUARD_CANARY, h->size);
    init_set((void*)h->lo, h->size, false); /* a guard zone everywhere: nothing to read */
    g_heaps.push_back(h);
    publish();
    return (nvtxMemHeapHandle_t)h;
}

void nvtxMemRegionsRegister(nvtxDomainHandle_t, nvtxMemRegionsRegisterBatch_t const* b) {
    const char* api = "nvtxMemRegionsRegister";
    if (!b || b->extCompatID != NVTX_EXT_COMPATID_MEM || b->regionType != NVTX_MEM_TYPE_VIRTUAL_ADDRESS ||
        b->regionDescElementSize != sizeof(nvtxMemVirtualRangeDesc_t))
        fatal("%s: only virtual-address regions are emulated", api);
    Heap* h = (Heap*)b->heap;
    if (std::find(g_heaps.begin(), g_heaps.end(), h) == g_heaps.end()) fatal("%s: a heap nvtxMemHeapRegister did not return", api);
    const nvtxMemVirtualRangeDesc_t* rs = (const nvtxMemVirtualRangeDesc_t*)b->regionDescElements;
    for (size_t i = 0; i < b->regionCount; i++) {
        uintptr_t lo = (uintptr_t)rs[i].ptr;
        if (lo < h->lo || rs[i].size > h->size || lo - h->lo > h->size - rs[i].size)
            fatal("%s: region of %zu bytes at %p outside heap '%s'", api, rs[i].size, rs[i].ptr, h->name.c_str());
        for (size_t j = 0; j < rs[i].size; j++)
            if (!h->guard[lo - h->lo + j]) fatal("%s: region of %zu bytes at %p overlaps another region", api, rs[i].size, rs[i].ptr);
        memset(&h->guard[lo - h->lo], 0, rs[i].size);
        memset((void*)lo, 0xff, rs[i].size); /* uninitialised (NaN), as every allocation here */
        init_set((void*)lo, rs[i].size, false); /* and unwritten for initcheck: a read before the next write stops */
        Region r{lo, rs[i].size, "?"};
        h->regions.insert(std::upper_bound(h->regions.begin(), h->regions.end(), r, [](const Region& x, const Region& y) { return x.lo < y.lo; }),
                          r);
    }
    find_gaps(h);
}

void nvtxMemRegionsUnregister(nvtxDomainHandle_t, nvtxMemRegionsUnregisterBatch_t const* b) {
    const char* api = "nvtxMemRegionsUnregister";
    if (!b || b->extCompatID != NVTX_EXT_COMPATID_MEM || b->refType != NVTX_MEM_REGION_REF_TYPE_POINTER ||
        b->refElementSize != sizeof(nvtxMemRegionRef_t))
        fatal("%s: only regions named by pointer are emulated", api);
    flush(); /* queued work still uses the region */
    for (size_t i = 0; i < b->refCount; i++) {
        uintptr_t a = (uintptr_t)b->refElements[i].pointer;
        Heap* h = heap_of(a);
        const Region* r = h ? region_of(h, a) : nullptr;
        if (!r || r->lo != a) fatal("%s: %p is not the start of a registered region", api, (void*)a);
        memset(&h->guard[a - h->lo], 1, r->size);
        memset((void*)a, GUARD_CANARY, r->size);
        init_set((void*)a, r->size, false);
        h->regions.erase(h->regions.begin() + (r - h->regions.data()));
        find_gaps(h);
    }
}

void nvtxMemRegionsName(nvtxDomainHandle_t, nvtxMemRegionsNameBatch_t const* b) {
    if (!b || b->extCompatID != NVTX_EXT_COMPATID_MEM || b->regionElementSize != sizeof(nvtxMemRegionNameDesc_t))
        fatal("nvtxMemRegionsName: a batch form that is not emulated");
    for (size_t i = 0; i < b->regionCount; i++) {
        const nvtxMemRegionNameDesc_t& d = b->regionElements[i];
        if (d.regionRefType != NVTX_MEM_REGION_REF_TYPE_POINTER || d.nameType != NVTX_MESSAGE_TYPE_ASCII)
            fatal("nvtxMemRegionsName: only regions named by pointer with an ASCII name are emulated");
        uintptr_t a = (uintptr_t)d.region.pointer;
        Heap* h = heap_of(a);
        Region* r = h ? (Region*)region_of(h, a) : nullptr;
        if (!r || r->lo != a) fatal("nvtxMemRegionsName: %p is not the start of a registered region", d.region.pointer);
        r->name = d.name.ascii ? d.name.ascii : "?";
    }
}
