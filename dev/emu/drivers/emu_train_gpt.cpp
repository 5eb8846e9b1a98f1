/*
 * emu_train_gpt.cpp: train_gpt (the CUDA trainer, its own main) built for
 * remat's CPU emulator of CUDA (dev/emu). NOT a GPU: losses from this binary
 * check the trainer's driver logic (data, schedule, checkpoints, resume,
 * recompute) under emulation, never GPU behaviour or speed.
 *
 * Why it exists: an end-to-end run of the CUDA trainer (a few steps on tiny
 * shards, a checkpoint and a bitwise-identical resume) in CI without a GPU.
 * The device it reports is named "EMU (CPU emulation of CUDA, not a GPU)".
 */
#include "train_gpt.cu"
