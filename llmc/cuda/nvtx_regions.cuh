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

#include "../plan/plan.h"

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

/* Unregisters the region that starts at base. */
static inline void nvtx_unregister_region(nvtxDomainHandle_t domain, const void* base) {
    nvtxMemRegionRef_t ref;
    ref.pointer = base;
    nvtxMemRegionsUnregisterBatch_t batch;
    memset(&batch, 0, sizeof(batch));
    batch.extCompatID = NVTX_EXT_COMPATID_MEM;
    batch.structSize = sizeof(batch);
    batch.refType = NVTX_MEM_REGION_REF_TYPE_POINTER;
    batch.refCount = 1;
    batch.refElementSize = sizeof(ref);
    batch.refElements = &ref;
    nvtxMemRegionsUnregister(domain, &batch);
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

static nvtxDomainHandle_t nvtx_plan_domain;
static nvtxMemHeapHandle_t nvtx_plan_heap; /* the arena registered last */

/* The arena as a heap whose plan entries ("layer3.qkv", "backward.dres", ...) are its only accessible regions. */
static inline void nvtx_register_plan(const MemoryPlan* plan, const char* arena) {
    if (!nvtx_plan_domain) nvtx_plan_domain = nvtxDomainCreateA("remat");
    nvtx_plan_heap = nvtx_register_heap(nvtx_plan_domain, arena, plan->total_bytes, "remat memory plan");
    for (int i = 0; i < plan->num_entries; i++) {
        const PlanEntry* e = &plan->entries[i];
        if (e->bytes) nvtx_register_region(nvtx_plan_domain, nvtx_plan_heap, arena + e->offset, e->bytes, e->name);
    }
}

/* Entries whose contents a forward pass never reads before writing them:
 * every activation and scratch buffer except the tokens, token buckets and
 * packed documents' starts and position runs uploaded before it, and the
 * host I/O staging. */
static inline int plan_entry_dead_at_forward(const PlanEntry* e) {
    static const char* const live[] = {"inputs", "targets", "token_buckets", "documents.starts", "documents.position_runs",
                                       "dataloader_tokens", "io_staging"};
    if (e->section != SEC_ACTIVATIONS && e->section != SEC_SCRATCH) return 0;
    for (size_t i = 0; i < sizeof(live) / sizeof(live[0]); i++)
        if (strcmp(e->name, live[i]) == 0) return 0;
    return 1;
}

/* At the start of a forward pass: the dead entries are registered anew, as
 * memory nothing has written (the emulator refills them with NaN bytes, so a
 * read of last step's values before this step's write shows as NaN; what a
 * GPU tool makes of it is unverified). */
static inline void nvtx_renew_dead_buffers(const MemoryPlan* plan, const char* arena) {
    for (int i = 0; i < plan->num_entries; i++) {
        const PlanEntry* e = &plan->entries[i];
        if (!e->bytes || !plan_entry_dead_at_forward(e)) continue;
        nvtx_unregister_region(nvtx_plan_domain, arena + e->offset);
        nvtx_register_region(nvtx_plan_domain, nvtx_plan_heap, arena + e->offset, e->bytes, e->name);
    }
}

#endif
