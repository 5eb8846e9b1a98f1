/*
 * Shapes of the GPU's scratch buffers that the plan sizes (plan/plan.h) and
 * the kernels fill (cuda/): one definition, so that neither includes the
 * other. Constants, not functions of the device, so that a result's bits do
 * not depend on the GPU model.
 */
#ifndef REMAT_GPU_SCRATCH_H
#define REMAT_GPU_SCRATCH_H

/* Row slices of the deterministic column sums (bias and LayerNorm parameter
 * gradients): cuda/cuda_common.cuh's column_finish_kernel adds them in order. */
#define GPU_COLUMN_SPLITS 32
/* Blocks of the gradient-norm reduction (cuda/global_norm.cuh). */
#define GPU_NORM_BLOCKS 512

#endif
