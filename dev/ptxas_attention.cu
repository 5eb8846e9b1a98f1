/* The attention kernels alone (every family, head size and instantiation the
 * trainer launches), for dev/ptxas_check.py's register budgets and spill check
 * at build time (`make cuda-all`): a translation unit far quicker to compile
 * than test_gpt.cu. */
#include "llmc/cuda/attention.cuh"
