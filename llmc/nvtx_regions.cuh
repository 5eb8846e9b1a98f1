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

/* The arena as a heap whose plan entries are its only accessible regions. */
static inline void nvtx_register_plan(const MemoryPlan* plan, const char* arena) {
    nvtxDomainHandle_t domain = nvtxDomainCreateA("remat");
    nvtxMemVirtualRangeDesc_t heap_range = {plan->total_bytes, arena};
    nvtxMemHeapDesc_t heap_desc;
    memset(&heap_desc, 0, sizeof(heap_desc));
    heap_desc.extCompatID = NVTX_EXT_COMPATID_MEM;
    heap_desc.structSize = sizeof(heap_desc);
    heap_desc.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
    heap_desc.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    heap_desc.typeSpecificDescSize = sizeof(heap_range);
    heap_desc.typeSpecificDesc = &heap_range;
    heap_desc.messageType = NVTX_MESSAGE_TYPE_ASCII;
    heap_desc.message.ascii = "remat memory plan";
    nvtxMemHeapHandle_t heap = nvtxMemHeapRegister(domain, &heap_desc);
    for (int i = 0; i < plan->num_entries; i++) {
        const PlanEntry* e = &plan->entries[i];
        if (!e->bytes) continue;
        nvtxMemVirtualRangeDesc_t range = {e->bytes, arena + e->offset};
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
        nd.region.pointer = arena + e->offset;
        nd.name.ascii = e->name; /* "layer3.qkv", "backward.dres", ... */
        nvtxMemRegionsNameBatch_t names;
        memset(&names, 0, sizeof(names));
        names.extCompatID = NVTX_EXT_COMPATID_MEM;
        names.structSize = sizeof(names);
        names.regionCount = 1;
        names.regionElementSize = sizeof(nd);
        names.regionElements = &nd;
        nvtxMemRegionsName(domain, &names);
    }
}

#endif
