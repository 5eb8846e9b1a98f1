/*
 * Pinned host memory on the GPU's NUMA node. On a machine with several
 * sockets each GPU hangs off one of them; pinned pages on the other socket
 * cross the inter-socket link on every copy (offloaded checkpoints stream
 * through the pinned pool twice a step). The node comes from CUDA
 * (cudaDevAttrHostNumaId, CUDA 12.2+: "the NUMA ID of the host node closest
 * to the device, or -1 when the system does not support NUMA"), else from
 * sysfs (/sys/bus/pci/devices/<bus id>/numa_node, -1 when the platform does
 * not say). The pool is then allocated by cudaMallocHost under a preferred
 * memory policy for that node (set_mempolicy(MPOL_PREFERRED), a raw system
 * call: no libnuma), restored at once: the driver allocates and pins the
 * pages in the call, so they follow the calling thread's policy; preferred,
 * not bound, so a full node falls back to another instead of failing. The
 * node of the first and last pages is read back (get_mempolicy with
 * MPOL_F_NODE | MPOL_F_ADDR) and printed in one line; where the node is
 * unknown or the policy cannot be set, one line says so and the OS places
 * the pages. Linux only (elsewhere: the notice and a plain cudaMallocHost).
 * Status: compiles, unverified on a multi-socket GPU machine; the emulator
 * states a device's node with EMU_HOST_NUMA_NODE (dev/emu/README.md).
 */
#ifndef REMAT_HOST_NUMA_CUH
#define REMAT_HOST_NUMA_CUH

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "cuda_common.cuh"
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
/* the kernel's values (linux/mempolicy.h), so that no numaif.h (libnuma) is needed */
#define HOST_NUMA_MPOL_DEFAULT 0
#define HOST_NUMA_MPOL_PREFERRED 1
#define HOST_NUMA_MPOL_F_NODE 1
#define HOST_NUMA_MPOL_F_ADDR 2
#endif

/* The host NUMA node nearest `device`, or -1; *source says where it came from. */
static inline int gpu_host_numa_node(int device, const char** source) {
    int node = -1;
#if CUDART_VERSION >= 12020
    if (cudaDeviceGetAttribute(&node, cudaDevAttrHostNumaId, device) == cudaSuccess && node >= 0) {
        *source = "cudaDevAttrHostNumaId";
        return node;
    }
    cudaGetLastError();
#endif
    *source = "unknown";
#ifdef __linux__
    char bus[32], path[96];
    if (cudaDeviceGetPCIBusId(bus, (int)sizeof(bus), device) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    for (char* c = bus; *c; c++) *c = (char)tolower((unsigned char)*c); /* sysfs spells the bus id in lower case */
    snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/numa_node", bus);
    FILE* f = fopen(path, "r");
    if (!f) return -1;
    if (fscanf(f, "%d", &node) != 1) node = -1;
    fclose(f);
    if (node >= 0) *source = "sysfs numa_node";
#endif
    return node < 0 ? -1 : node;
}

#ifdef __linux__
/* The node holding the page at addr, or -1. */
static inline int host_numa_node_of(const void* addr) {
    int node = -1;
    if (syscall(SYS_get_mempolicy, &node, NULL, 0UL, addr, (unsigned long)(HOST_NUMA_MPOL_F_NODE | HOST_NUMA_MPOL_F_ADDR)) != 0) return -1;
    return node;
}
#endif

/* cudaMallocHost of `bytes` on the current device's NUMA node where the
 * system says which (above); prints one line naming the node and where the
 * pages landed, or why they were left to the OS. Returns the CUDA error. */
static inline cudaError_t pinned_alloc_near_gpu(void** p, size_t bytes, const char* what) {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    const char* source = "unknown";
    const int node = gpu_host_numa_node(device, &source);
#ifdef __linux__
    if (node >= 0 && node < 1024) {
        unsigned long mask[1024 / (8 * sizeof(unsigned long))];
        memset(mask, 0, sizeof(mask));
        mask[node / (8 * sizeof(unsigned long))] = 1UL << (node % (8 * sizeof(unsigned long)));
        if (syscall(SYS_set_mempolicy, HOST_NUMA_MPOL_PREFERRED, mask, (unsigned long)(8 * sizeof(mask))) != 0) {
            printf("pinned memory (%s): NUMA node %d (%s) refused a memory policy (%s); the OS places the pages\n", what, node, source,
                   strerror(errno));
            return cudaMallocHost(p, bytes);
        }
        cudaError_t err = cudaMallocHost(p, bytes);
        syscall(SYS_set_mempolicy, HOST_NUMA_MPOL_DEFAULT, NULL, 0UL);
        if (err == cudaSuccess) {
            const int first = host_numa_node_of(*p), last = host_numa_node_of((const char*)*p + (bytes ? bytes - 1 : 0));
            printf("pinned memory (%s): %.1f MiB on NUMA node %d, the GPU's (%s); pages read back on nodes %d and %d (first, last)\n", what,
                   (double)bytes / 1048576.0, node, source, first, last);
        }
        return err;
    }
#endif
    printf("pinned memory (%s): the GPU's NUMA node is not known (no cudaDevAttrHostNumaId, no sysfs numa_node); the OS places the pages\n",
           what);
    return cudaMallocHost(p, bytes);
}

#endif
