# remat: GPT-2 training in C and CUDA with activation recomputation.
#   make train_gpt_cpu   CPU reference trainer (fp32, OpenMP)
#   make train_gpt       CUDA trainer (PRECISION=BF16|FP16|FP32)
#   make test            CPU test suite (no GPU needed)

CC ?= gcc
CFLAGS_BASE = -O3 -std=gnu11 -Wall -Wextra -Werror
CPU_ARCH ?= -march=native
OPENMP ?= -fopenmp
CFLAGS = $(CFLAGS_BASE) $(CPU_ARCH) $(OPENMP)
LDLIBS = -lm
BUILD = build

HEADERS = $(wildcard llmc/*.h)

.PHONY: all test test-c test-py clean

all: train_gpt_cpu

train_gpt_cpu: train_gpt.c $(HEADERS)
	$(CC) $(CFLAGS) -o $@ $< $(LDLIBS)

clean:
	rm -rf $(BUILD) train_gpt_cpu train_gpt test_gpt

# CUDA targets (train_gpt, test_gpt) live in cuda.mk
-include cuda.mk
