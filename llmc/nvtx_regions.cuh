/*
 * The plan's buffers as NVTX memory regions, so that a memory checker sees
 * each buffer's bounds rather than only the one cudaMalloc they are carved
 * from.
 *
 * Why: the trainer allocates the whole plan as one arena (plan.h), so an
 * access that runs from one buffer into the next stays inside a valid
 * allocation. Registering the arena as a sub-allocator heap and every plan
 * entry as a region in it tells `compute-sanitizer --tool memcheck` (which
 * reads NVTX through its injection library) that only the regions may be
 * touched, and under the CPU emulator (dev/emu, whose stand-in of this
 * header implements the same calls) every access is checked against them:
 * the bytes between entries are guard zones. The plan leaves at least
 * PLAN_GUARD_BYTES between entries (256 in emulated builds; 0, the bare
 * 256-byte alignment slack, unless a build sets it). NVTX3 is header-only:
 * without a tool attached each call returns at once. Compiles; unverified
 * on GPU.
 */
#ifndef REMAT_NVTX_REGIONS_CUH
#define REMAT_NVTX_REGIONS_CUH

#include <nvtx3/nvToolsExtMem.h>
#include <string.h>

#include "plan.h"

/* Registers bytes at base as a sub-allocator heap named `name`: under a
 * memory checker, only its regions may then be accessed. */
static inline nvtxMemHeapHandle_t nvtx_register_heap(nvtxDomainHandle_t domain, const void* base, size_t bytes, const char* name) {
    nvtxMemVirtualRangeDesc_t range = {bytes, base};
    nvtxMemHeapDesc_t desc;
    memset(&desc, 0, sizeof(desc));
    desc.extCompatID = NVTX_EXT_COMPATID_MEM;
    desc.structSize = sizeof(desc);
    desc.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
    desc.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    desc.typeSpecificDescSize = sizeof(range);
    desc.typeSpecificDesc = &range;
    desc.messageType = NVTX_MESSAGE_TYPE_ASCII;
    desc.message.ascii = name;
    return nvtxMemHeapRegister(domain, &desc);
}

/* Registers bytes at base, inside heap, as a region named `name`. */
static inline void nvtx_register_region(nvtxDomainHandle_t domain, nvtxMemHeapHandle_t heap, const void* base, size_t bytes,
                                        const char* name) {
    nvtxMemVirtualRangeDesc_t range = {bytes, base};
    nvtxMemRegionsRegisterBatch_t batch;
    memset(&batch, 0, sizeof(batch));
    batch.extCompatID = NVTX_EXT_COMPATID_MEM;
    batch.structSize = sizeof(batch);
    batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    batch.heap = heap;
    batch.regionCount = 1;
    batch.regionDescElementSize = sizeof(range);
    batch.regionDescElements = &range;
    nvtxMemRegionsRegister(domain, &batch);
    nvtxMemRegionNameDesc_t nd;
    memset(&nd, 0, sizeof(nd));
    nd.regionRefType = NVTX_MEM_REGION_REF_TYPE_POINTER;
    nd.nameType = NVTX_MESSAGE_TYPE_ASCII;
    nd.region.pointer = base;
    nd.name.ascii = name;
    nvtxMemRegionsNameBatch_t names;
    memset(&names, 0, sizeof(names));
    names.extCompatID = NVTX_EXT_COMPATID_MEM;
    names.structSize = sizeof(names);
    names.regionCount = 1;
    names.regionElementSize = sizeof(nd);
    names.regionElements = &nd;
    nvtxMemRegionsName(domain, &names);
}

/* The arena as a heap whose plan entries ("layer3.qkv", "backward.dres", ...) are its only accessible regions. */
static inline void nvtx_register_plan(const MemoryPlan* plan, const char* arena) {
    nvtxDomainHandle_t domain = nvtxDomainCreateA("remat");
    nvtxMemHeapHandle_t heap = nvtx_register_heap(domain, arena, plan->total_bytes, "remat memory plan");
    for (int i = 0; i < plan->num_entries; i++) {
        const PlanEntry* e = &plan->entries[i];
        if (e->bytes) nvtx_register_region(domain, heap, arena + e->offset, e->bytes, e->name);
    }
}

#endif
