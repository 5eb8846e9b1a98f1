# CUDA targets, included by the Makefile (-include cuda.mk). Status: see the
# status table in README.md.
#
#   make train_gpt test_gpt           PRECISION=BF16 (default) | FP16 | FP32
#   make train_gpt GPU_COMPUTE_CAPABILITY=90   one architecture (sm_90) only
#   make cuda-all                     every CUDA target in every precision:
#                                     build/train_gpt_bf16 build/test_gpt_bf16 ...
#                                     and build/bench_attention_bf16
#
# GPU_COMPUTE_CAPABILITY: taken from the command line or environment when set
# (an empty value forces the fat binary); otherwise detected with nvidia-smi
# when it works; otherwise a fat binary for sm_80 and sm_90 (+ compute_90 PTX
# for newer GPUs). NCCL and MPI are used when found (multi-GPU, below), never
# needed. train_gpt and test_gpt do not track PRECISION: run `make clean` (or
# use cuda-all's names) when switching.

NVCC ?= $(shell command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)
PRECISION ?= BF16
BUILD ?= build
CUDA_PRECISIONS ?= bf16 fp32 fp16

PREC_FLAG_BF16 = -DENABLE_BF16
PREC_FLAG_FP32 = -DENABLE_FP32
PREC_FLAG_FP16 = -DENABLE_FP16
PREC_FLAG_bf16 = $(PREC_FLAG_BF16)
PREC_FLAG_fp32 = $(PREC_FLAG_FP32)
PREC_FLAG_fp16 = $(PREC_FLAG_FP16)

ifeq ($(origin GPU_COMPUTE_CAPABILITY),undefined)
GPU_COMPUTE_CAPABILITY := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .\r' | grep -E '^[0-9]+$$')
endif

ifneq ($(strip $(GPU_COMPUTE_CAPABILITY)),)
GENCODE = -gencode arch=compute_$(strip $(GPU_COMPUTE_CAPABILITY)),code=sm_$(strip $(GPU_COMPUTE_CAPABILITY))
else
GENCODE = -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
endif

# Warnings are errors (device and host code); CUDA_WERROR= turns that off for an
# unfamiliar toolchain (dev/gpu_check.sh does, so a new host compiler's new
# warning cannot cost a borrowed GPU's time).
CUDA_WERROR ?= -Werror all-warnings -Xcompiler -Werror
# OpenMP on the host: parameter init and file conversion use every core.
# ATTENTION: the attention kernels of BF16/FP16 builds (FP32 builds always use
# simt). mma (the default): inline-PTX mma.sync/ldmatrix/cp.async kernels
# for head sizes 64 and 128, the WMMA ones for other head sizes (noted at
# start-up); tc: the WMMA kernels for every head size; simt: the CUDA-core
# kernels (for GPUs below sm_80, and for comparing). Default: mma, or simt
# when GPU_COMPUTE_CAPABILITY names an architecture below sm_80. Not tracked
# either: `make clean` after changing it.
ifeq ($(origin ATTENTION),undefined)
ATTENTION := $(if $(shell [ -n "$(strip $(GPU_COMPUTE_CAPABILITY))" ] && [ "$(strip $(GPU_COMPUTE_CAPABILITY))" -lt 80 ] 2>/dev/null && echo old),simt,mma)
endif
ifeq ($(ATTENTION),simt)
ATTENTION_FLAGS = -DATTENTION_SIMT
else ifeq ($(ATTENTION),tc)
ATTENTION_FLAGS = -DATTENTION_TC
else ifneq ($(ATTENTION),mma)
$(error ATTENTION=$(ATTENTION): use mma (inline PTX, the default), tc (WMMA) or simt (CUDA cores))
endif
NVCC_FLAGS = -O3 -std=c++17 -I. $(GENCODE) $(ATTENTION_FLAGS) -Xcompiler -Wall,-Wextra,-fopenmp $(CUDA_WERROR)
NVCC_LDLIBS = -lcublasLt -lcublas -lgomp
# test_gpt also builds the CPU reference (train_gpt.c) in, with OpenMP.
NVCC_TEST_FLAGS = -Xcompiler -Wno-unused-function $(if $(strip $(CPU_ARCH)),-Xcompiler $(strip $(CPU_ARCH)))
NVCC_TEST_LDLIBS =

CUDA_DEPS = $(wildcard llmc/*/*.h llmc/*/*.cuh)

# ---- several GPUs: NCCL + MPI (llmc/cuda/multigpu.cuh) ----
# train_gpt and build/train_gpt_<precision> are built with -DUSE_MPI -DMULTI_GPU
# (one process per GPU under mpirun or srun, NCCL collectives) when both nccl.h
# with libnccl.so and an OpenMPI mpicc (for --showme:compile/--showme:link) are
# found; NO_MULTI_GPU=1 or NO_USE_MPI=1 turns that off (no MPI, no multi-GPU).
# train_gpt_nompi and build/train_gpt_nompi_<precision> are always the plain
# single-process build, to compare against. test_gpt never uses either.
# `make cuda-info` prints what was found. Overrides: NCCL_HOME or
# NCCL_INCLUDE_DIR and NCCL_LIB_DIR; MPI_CFLAGS and MPI_LDFLAGS (for an mpicc
# without --showme, e.g. MPICH's: the -I and the -L/-l parts of `mpicc -show`).
# Like PRECISION, the choice is not tracked: `make clean` (or touch
# train_gpt.cu) after changing it.
comma := ,
ifneq ($(filter 1,$(NO_MULTI_GPU) $(NO_USE_MPI)),)
MULTI_GPU_WHY := off by $(if $(filter 1,$(NO_USE_MPI)),NO_USE_MPI=1,NO_MULTI_GPU=1)
else
ifeq ($(origin NCCL_INCLUDE_DIR),undefined)
NCCL_INCLUDE_DIR := $(abspath $(patsubst %/nccl.h,%,$(firstword $(wildcard $(addsuffix /nccl.h,$(if $(NCCL_HOME),$(NCCL_HOME)/include) \
    $(if $(CUDA_HOME),$(CUDA_HOME)/include) $(dir $(NVCC))../include /usr/local/cuda/include /usr/include /usr/local/include)))))
endif
ifeq ($(origin NCCL_LIB_DIR),undefined)
NCCL_LIB_DIR := $(abspath $(patsubst %/libnccl.so,%,$(firstword $(wildcard $(addsuffix /libnccl.so,$(if $(NCCL_HOME),$(NCCL_HOME)/lib $(NCCL_HOME)/lib64) \
    $(if $(NCCL_INCLUDE_DIR),$(NCCL_INCLUDE_DIR)/../lib64 $(NCCL_INCLUDE_DIR)/../lib) /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib /usr/local/lib)))))
endif
MULTI_GPU_MPICC := $(shell command -v mpicc 2>/dev/null)
ifeq ($(origin MPI_CFLAGS),undefined)
MPI_CFLAGS := $(if $(MULTI_GPU_MPICC),$(shell $(MULTI_GPU_MPICC) --showme:compile 2>/dev/null))
endif
ifeq ($(origin MPI_LDFLAGS),undefined)
MPI_LDFLAGS := $(if $(MULTI_GPU_MPICC),$(shell $(MULTI_GPU_MPICC) --showme:link 2>/dev/null))
endif
MULTI_GPU_WHY := $(if $(NCCL_INCLUDE_DIR),,no nccl.h found; )$(if $(NCCL_LIB_DIR),,no libnccl.so found; )$(if $(filter -lmpi%,$(MPI_LDFLAGS)),,no MPI link flags (mpicc --showme:link); )
endif
# mpicc's flags as nvcc options: -I -D -L -l as they are, -Wl,x to the linker, the rest to the host compiler
nvcc_mpi_flags = $(foreach f,$(1),$(if $(filter -I% -D% -L% -l%,$(f)),$(f),$(if $(filter -Wl$(comma)%,$(f)),-Xlinker $(patsubst -Wl$(comma)%,%,$(f)),-Xcompiler $(f))))
ifeq ($(strip $(MULTI_GPU_WHY)),)
MULTI_GPU_STATUS := on: nccl.h in $(NCCL_INCLUDE_DIR), libnccl.so in $(NCCL_LIB_DIR), MPI from $(MULTI_GPU_MPICC)
MULTI_GPU_FLAGS = -DUSE_MPI -DMULTI_GPU -DOMPI_SKIP_MPICXX -DMPICH_SKIP_MPICXX \
    $(if $(filter /usr/include /usr/local/include $(abspath $(dir $(NVCC))../include),$(NCCL_INCLUDE_DIR)),,-I$(NCCL_INCLUDE_DIR)) \
    $(call nvcc_mpi_flags,$(MPI_CFLAGS))
MULTI_GPU_LDLIBS = -L$(NCCL_LIB_DIR) -Xlinker -rpath$(comma)$(NCCL_LIB_DIR) -lnccl $(call nvcc_mpi_flags,$(MPI_LDFLAGS))
else
MULTI_GPU_STATUS := off: $(MULTI_GPU_WHY)
MULTI_GPU_FLAGS =
MULTI_GPU_LDLIBS =
endif
check_precision = $(if $(PREC_FLAG_$(1)),,$(error PRECISION=$(1) is not one of BF16, FP16, FP32))

.PHONY: cuda-all cuda-info

cuda-info:
	@echo "nvcc: $(NVCC)"
	@echo "GPU_COMPUTE_CAPABILITY: $(if $(strip $(GPU_COMPUTE_CAPABILITY)),$(strip $(GPU_COMPUTE_CAPABILITY)),unset (fat binary))"
	@echo "multi-GPU (NCCL + MPI) in train_gpt: $(MULTI_GPU_STATUS)"

train_gpt: train_gpt.cu $(CUDA_DEPS) $(call mpi_stamp,gpu,$(MULTI_GPU_FLAGS))
	$(call check_precision,$(PRECISION))
	$(NVCC) $(NVCC_FLAGS) $(PREC_FLAG_$(PRECISION)) $(MULTI_GPU_FLAGS) -o $@ $< $(NVCC_LDLIBS) $(MULTI_GPU_LDLIBS)

train_gpt_nompi: train_gpt.cu $(CUDA_DEPS)
	$(call check_precision,$(PRECISION))
	$(NVCC) $(NVCC_FLAGS) $(PREC_FLAG_$(PRECISION)) -o $@ $< $(NVCC_LDLIBS)

test_gpt: test_gpt.cu train_gpt.cu train_gpt.c $(CUDA_DEPS)
	$(call check_precision,$(PRECISION))
	$(NVCC) $(NVCC_FLAGS) $(NVCC_TEST_FLAGS) $(PREC_FLAG_$(PRECISION)) -o $@ $< $(NVCC_LDLIBS) $(NVCC_TEST_LDLIBS)

# bench_attention (dev/bench/bench_attention.cu) times the mma, tc and simt
# attention kernels side by side: BF16 only, and not with ATTENTION=simt.
cuda-all: $(foreach p,$(CUDA_PRECISIONS),$(BUILD)/train_gpt_$(p) $(BUILD)/test_gpt_$(p)) $(if $(filter simt,$(ATTENTION)),,$(BUILD)/bench_attention_bf16)

$(BUILD)/bench_attention_%: dev/bench/bench_attention.cu $(CUDA_DEPS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(PREC_FLAG_$*) -o $@ $< $(NVCC_LDLIBS)

# bench_memory (dev/bench/bench_memory.cu): the memory-bound kernels' vector
# paths against their scalar paths, side by side.
cuda-all: $(BUILD)/bench_memory_bf16
$(BUILD)/bench_memory_%: dev/bench/bench_memory.cu $(CUDA_DEPS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(PREC_FLAG_$*) -o $@ $< $(NVCC_LDLIBS)

# The attention kernels' register budgets, stack frames and spills, asserted
# at build (dev/ptxas_check.py on dev/ptxas_attention.cu, BF16 and FP16): sm_90
# whatever GPU_COMPUTE_CAPABILITY, as the budgets (llmc/cuda/attention_mma.cuh's
# AttMmaRegs) are sm_90 figures. The report is kept in build/ptxas_attention_*.log.
cuda-all: $(BUILD)/ptxas_attention_bf16.ok $(BUILD)/ptxas_attention_fp16.ok
$(BUILD)/ptxas_attention_%.ok: dev/ptxas_attention.cu dev/ptxas_check.py $(CUDA_DEPS)
	@mkdir -p $(@D)
	@python3 dev/ptxas_check.py --source dev/ptxas_attention.cu --arch 90 --define $(patsubst -D%,%,$(PREC_FLAG_$*)) --nvcc $(NVCC) \
	    > $(BUILD)/ptxas_attention_$*.log 2>&1 || { grep -E '^ptxas_check: FAIL' $(BUILD)/ptxas_attention_$*.log || tail -n 40 $(BUILD)/ptxas_attention_$*.log; exit 1; }
	@grep '^ptxas_check: PASS' $(BUILD)/ptxas_attention_$*.log | sed 's/^/$*: /'
	@touch $@

$(BUILD)/train_gpt_%: train_gpt.cu $(CUDA_DEPS) $(call mpi_stamp,gpu,$(MULTI_GPU_FLAGS))
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(PREC_FLAG_$*) $(MULTI_GPU_FLAGS) -o $@ $< $(NVCC_LDLIBS) $(MULTI_GPU_LDLIBS)

# the shorter stem wins: build/train_gpt_nompi_bf16 comes from here
$(BUILD)/train_gpt_nompi_%: train_gpt.cu $(CUDA_DEPS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(PREC_FLAG_$*) -o $@ $< $(NVCC_LDLIBS)

$(BUILD)/test_gpt_%: test_gpt.cu train_gpt.cu train_gpt.c $(CUDA_DEPS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(NVCC_TEST_FLAGS) $(PREC_FLAG_$*) -o $@ $< $(NVCC_LDLIBS) $(NVCC_TEST_LDLIBS)
