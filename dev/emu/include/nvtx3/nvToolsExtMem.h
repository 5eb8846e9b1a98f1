/*
 * nvtx3/nvToolsExtMem.h stand-in for remat's CPU emulator of CUDA (dev/emu;
 * not a GPU): the NVTX memory-region calls llmc/cuda/nvtx_regions.cuh makes,
 * with the real header's types and fields for them.
 *
 * Why it exists: on a GPU these calls tell compute-sanitizer's memcheck that
 * a cudaMalloc block is a heap whose registered regions are the only memory
 * that may be touched. The emulator does the same check itself: the bytes of
 * a sub-allocator heap outside every region are guard zones (filled with a
 * canary), and any kernel access to them (every access is instrumented, see
 * runtime/emu_racecheck.cpp), any WMMA tile, cuBLASLt operand, copy or memset
 * that leaves its region, stops the program naming the region. Only the
 * virtual-address, sub-allocator, one-region-per-batch forms are emulated;
 * anything else stops the program.
 */
#ifndef REMAT_EMU_NVTOOLSEXTMEM_H
#define REMAT_EMU_NVTOOLSEXTMEM_H

#include <stddef.h>
#include <stdint.h>

#define NVTX_EXT_COMPATID_MEM 0x0102
#define NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR 0x1
#define NVTX_MEM_TYPE_VIRTUAL_ADDRESS 0x1
#define NVTX_MEM_REGION_REF_TYPE_POINTER 0x1
#define NVTX_MESSAGE_TYPE_ASCII 1

typedef struct nvtxDomainRegistration_st* nvtxDomainHandle_t;
typedef struct nvtxMemHeap_st* nvtxMemHeapHandle_t;
typedef struct nvtxMemRegion_st* nvtxMemRegionHandle_t;

typedef union nvtxMessageValue_t {
    const char* ascii;
    const wchar_t* unicode;
    void* registered;
} nvtxMessageValue_t;

typedef struct nvtxMemVirtualRangeDesc_v1 {
    size_t size;
    void const* ptr;
} nvtxMemVirtualRangeDesc_t;

typedef struct nvtxMemHeapDesc_v1 {
    uint16_t extCompatID;
    uint16_t structSize;
    uint32_t reserved0;
    uint32_t usage;
    uint32_t type;
    size_t typeSpecificDescSize;
    void const* typeSpecificDesc;
    uint32_t category;
    uint32_t messageType;
    nvtxMessageValue_t message;
} nvtxMemHeapDesc_t;

typedef struct nvtxMemRegionsRegisterBatch_v1 {
    uint16_t extCompatID;
    uint16_t structSize;
    uint32_t regionType;
    nvtxMemHeapHandle_t heap;
    size_t regionCount;
    size_t regionDescElementSize;
    void const* regionDescElements;
    nvtxMemRegionHandle_t* regionHandleElementsOut;
} nvtxMemRegionsRegisterBatch_t;

typedef union nvtxMemRegionRef_t {
    void const* pointer;
    nvtxMemRegionHandle_t handle;
} nvtxMemRegionRef_t;

typedef struct nvtxMemRegionsUnregisterBatch_v1 {
    uint16_t extCompatID;
    uint16_t structSize;
    uint32_t refType;
    size_t refCount;
    size_t refElementSize;
    nvtxMemRegionRef_t const* refElements;
} nvtxMemRegionsUnregisterBatch_t;

typedef struct nvtxMemRegionNameDesc_v1 {
    uint32_t regionRefType;
    uint32_t nameType;
    nvtxMemRegionRef_t region;
    nvtxMessageValue_t name;
    uint32_t category;
    uint32_t reserved0;
} nvtxMemRegionNameDesc_t;

typedef struct nvtxMemRegionsNameBatch_v1 {
    uint16_t extCompatID;
    uint16_t structSize;
    uint32_t reserved0;
    size_t regionCount;
    size_t regionElementSize;
    nvtxMemRegionNameDesc_t const* regionElements;
    size_t reserved1;
} nvtxMemRegionsNameBatch_t;

nvtxDomainHandle_t nvtxDomainCreateA(const char* name);
nvtxMemHeapHandle_t nvtxMemHeapRegister(nvtxDomainHandle_t domain, nvtxMemHeapDesc_t const* desc);
void nvtxMemRegionsRegister(nvtxDomainHandle_t domain, nvtxMemRegionsRegisterBatch_t const* desc);
void nvtxMemRegionsName(nvtxDomainHandle_t domain, nvtxMemRegionsNameBatch_t const* desc);
/* The emulator: the region's bytes become guard bytes again; registering it anew refills it with NaN bytes (0xff). */
void nvtxMemRegionsUnregister(nvtxDomainHandle_t domain, nvtxMemRegionsUnregisterBatch_t const* desc);

#endif
