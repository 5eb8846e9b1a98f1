# remat: GPT-2 training in C and CUDA with activation recomputation.
#   make train_gpt_cpu   CPU reference trainer (fp32, OpenMP)
#   make train_gpt       CUDA trainer (PRECISION=BF16|FP16|FP32)
#   make test            CPU test suite (no GPU needed)

CC ?= gcc
# -fno-math-errno (and no other fast-math flag): math functions need not set
# errno, so AdamW's sqrtf vectorises; every result is unchanged.
CFLAGS_BASE = -O3 -std=gnu11 -fno-math-errno -Wall -Wextra -Werror $(FMA_CHAINS)
# GCC tuned for AMD Zen (-march=native there) splits the multiply-adds of a
# single accumulator chain into a multiply and an add ("avoid FMA chains"),
# but not those of the register tiles: the scalar and vector tails of the CPU
# matmuls would then round twice where the tiles round once, and an element's
# bits would depend on where it falls (dev/test/test_matmul_order.c). Keep
# every contraction, where the compiler knows the parameter.
FMA_CHAINS := $(shell $(CC) --param=avoid-fma-max-bits=0 -Werror -E -x c /dev/null >/dev/null 2>&1 && echo --param=avoid-fma-max-bits=0)
CPU_ARCH ?= -march=native
OPENMP ?= -fopenmp
CFLAGS = $(CFLAGS_BASE) $(CPU_ARCH) $(OPENMP)
LDLIBS = -lm
BUILD = build

# MPI for multi-process training: used when mpicc is found, NO_USE_MPI=1 turns it off.
ifeq ($(NO_USE_MPI),1)
  MPICC :=
else
  MPICC := $(shell command -v mpicc 2>/dev/null)
endif
ifneq ($(MPICC),)
  CPU_TRAINER_CC = $(MPICC)
  MPI_FLAGS = -DUSE_MPI
else
  CPU_TRAINER_CC = $(CC)
  MPI_FLAGS =
endif

HEADERS = $(wildcard llmc/*/*.h)

.PHONY: all test test-bins deps clean fuzz

all: train_gpt_cpu

# Binaries built with or without MPI depend on a stamp whose name says which:
# when mpicc appears or disappears the stamp changes, and they are rebuilt.
mpi_stamp = $(BUILD)/.mpi-$(1)-$(if $(2),on,off)
$(BUILD)/.mpi-%: | $(BUILD)
	rm -f $(BUILD)/.mpi-$(firstword $(subst -, ,$*))-*
	touch $@

train_gpt_cpu: train_gpt.c $(HEADERS) $(call mpi_stamp,cpu,$(MPICC))
	$(CPU_TRAINER_CC) $(CFLAGS) $(MPI_FLAGS) -o $@ $< $(LDLIBS)

clean:
	rm -rf $(BUILD) train_gpt_cpu train_gpt train_gpt_nompi test_gpt

# CUDA targets (train_gpt, test_gpt) live in cuda.mk
-include cuda.mk

# ---- tests ----
# Tests include train_gpt.c whole and use part of it.
TEST_CFLAGS = $(CFLAGS) -Wno-unused-function
TEST_BINS = $(BUILD)/test_loss_scaler $(BUILD)/test_dropout $(BUILD)/test_dropout_sites $(BUILD)/test_gradcheck $(BUILD)/test_gradcheck_llama $(BUILD)/test_recompute $(BUILD)/test_plan $(BUILD)/test_matmul_order $(BUILD)/read_data \
            $(BUILD)/test_documents $(BUILD)/test_documents_fp64
SANITIZE = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all

$(BUILD):
	mkdir -p $(BUILD)

$(BUILD)/test_gradcheck: dev/test/test_gradcheck.c dev/test/test_model.h train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -DREMAT_FP64 -o $@ $< $(LDLIBS)

$(BUILD)/test_gradcheck_llama: dev/test/test_gradcheck_llama.c dev/test/test_model.h train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -DREMAT_FP64 -o $@ $< $(LDLIBS)

# The fp64 check of the context-parallel ring: needs MPI, runs under mpirun -np 2.
$(BUILD)/test_ring_gradcheck: dev/test/test_ring_gradcheck.c dev/test/test_model.h train_gpt.c $(HEADERS) | $(BUILD)
	$(MPICC) $(TEST_CFLAGS) -DUSE_MPI -DREMAT_FP64 -o $@ $< $(LDLIBS)

$(BUILD)/test_documents: dev/test/test_documents.c dev/test/test_model.h train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)

$(BUILD)/test_documents_fp64: dev/test/test_documents.c dev/test/test_model.h train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -DREMAT_FP64 -o $@ $< $(LDLIBS)

$(BUILD)/test_recompute: dev/test/test_recompute.c dev/test/test_model.h train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)

$(BUILD)/test_dropout_sites: dev/test/test_dropout_sites.c dev/test/test_model.h train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)

$(BUILD)/test_matmul_order: dev/test/test_matmul_order.c train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)

# The CPU matmuls alone (dev/bench/bench_cpu_matmul.c); not part of make test.
$(BUILD)/bench_cpu_matmul: dev/bench/bench_cpu_matmul.c train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)

$(BUILD)/test_plan: dev/test/test_plan.c dev/test/test_model.h train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(TEST_CFLAGS) -o $@ $< $(LDLIBS)

$(BUILD)/test_loss_scaler: dev/test/test_loss_scaler.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

$(BUILD)/test_dropout: dev/test/test_dropout.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

$(BUILD)/read_data: dev/test/read_data.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS) $(SANITIZE) -o $@ $< $(LDLIBS)

# The trainer under AddressSanitizer and UndefinedBehaviorSanitizer, for the
# bad-input tests (file parsers, flags). No OpenMP: its runtime confuses ASan.
$(BUILD)/train_gpt_cpu_asan: train_gpt.c $(HEADERS) | $(BUILD)
	$(CC) $(CFLAGS_BASE) $(CPU_ARCH) -Wno-unknown-pragmas -O1 -g $(SANITIZE) -o $@ $< $(LDLIBS)

# libFuzzer harnesses of every parser (dev/fuzz), with clang under ASan and
# UBSan; dev/test/test_fuzz.py runs each for REMAT_FUZZ_SECONDS. Built by
# test-bins when clang is found (.ci/run installs it).
CLANG ?= $(shell command -v clang 2>/dev/null)
FUZZERS = model shard tokenizer state done flags
FUZZ_BINS = $(FUZZERS:%=$(BUILD)/fuzz_%)
$(BUILD)/fuzz_%: dev/fuzz/fuzz_%.c dev/fuzz/fuzz_common.h $(HEADERS) | $(BUILD)
	$(CLANG) -O1 -g -std=gnu11 -Wall -Wextra -Werror -I. -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -o $@ $< -lm

fuzz: $(FUZZ_BINS)

test-bins: train_gpt_cpu $(TEST_BINS) $(BUILD)/train_gpt_cpu_asan $(if $(CLANG),$(FUZZ_BINS)) $(if $(MPICC),$(BUILD)/test_ring_gradcheck)

# Python packages the tests need, installed only when missing.
deps:
	@python3 -c "import numpy, pytest, tiktoken, tqdm, requests, safetensors, matplotlib" 2>/dev/null || python3 -m pip install -q -r dev/data/requirements.txt

# The README's test command. Every test, C and Python, runs under pytest.
test: deps test-bins
	python3 -m pytest -q dev/test
