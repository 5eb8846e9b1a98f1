# CUDA targets, included by the Makefile (-include cuda.mk). Status: compiles,
# unverified on GPU.
#
#   make train_gpt test_gpt           PRECISION=BF16 (default) | FP32
#   make train_gpt GPU_COMPUTE_CAPABILITY=90   one architecture (sm_90) only
#   make cuda-all                     every CUDA target in every precision:
#                                     build/train_gpt_bf16 build/test_gpt_bf16 ...
#
# GPU_COMPUTE_CAPABILITY: taken from the command line or environment when set
# (an empty value forces the fat binary); otherwise detected with nvidia-smi
# when it works; otherwise a fat binary for sm_80 and sm_90 (+ compute_90 PTX
# for newer GPUs). No NCCL or MPI is needed. train_gpt and test_gpt do not
# track PRECISION: run `make clean` (or use cuda-all's names) when switching.

NVCC ?= $(shell command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)
PRECISION ?= BF16
BUILD ?= build
CUDA_PRECISIONS ?= bf16 fp32

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
NVCC_FLAGS = -O3 -std=c++17 -I. $(GENCODE) -Xcompiler -Wall,-Wextra $(CUDA_WERROR)
NVCC_LDLIBS = -lcublasLt -lcublas
# test_gpt also builds the CPU reference (train_gpt.c) in, with OpenMP.
NVCC_TEST_FLAGS = -Xcompiler -fopenmp,-Wno-unused-function $(if $(strip $(CPU_ARCH)),-Xcompiler $(strip $(CPU_ARCH)))
NVCC_TEST_LDLIBS = -lgomp

CUDA_DEPS = $(wildcard llmc/*.h llmc/*.cuh)
check_precision = $(if $(PREC_FLAG_$(1)),,$(error PRECISION=$(1) is not one of BF16, FP32))

.PHONY: cuda-all

train_gpt: train_gpt.cu $(CUDA_DEPS)
	$(call check_precision,$(PRECISION))
	$(NVCC) $(NVCC_FLAGS) $(PREC_FLAG_$(PRECISION)) -o $@ $< $(NVCC_LDLIBS)

test_gpt: test_gpt.cu train_gpt.cu train_gpt.c $(CUDA_DEPS)
	$(call check_precision,$(PRECISION))
	$(NVCC) $(NVCC_FLAGS) $(NVCC_TEST_FLAGS) $(PREC_FLAG_$(PRECISION)) -o $@ $< $(NVCC_LDLIBS) $(NVCC_TEST_LDLIBS)

cuda-all: $(foreach p,$(CUDA_PRECISIONS),$(BUILD)/train_gpt_$(p) $(BUILD)/test_gpt_$(p))

$(BUILD)/train_gpt_%: train_gpt.cu $(CUDA_DEPS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(PREC_FLAG_$*) -o $@ $< $(NVCC_LDLIBS)

$(BUILD)/test_gpt_%: test_gpt.cu train_gpt.cu train_gpt.c $(CUDA_DEPS)
	@mkdir -p $(@D)
	$(NVCC) $(NVCC_FLAGS) $(NVCC_TEST_FLAGS) $(PREC_FLAG_$*) -o $@ $< $(NVCC_LDLIBS) $(NVCC_TEST_LDLIBS)
