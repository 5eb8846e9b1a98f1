/*
 * The training driver shared by both trainers, by job:
 *   backend.h          what a trainer supplies (Backend) and the run's settings (Run)
 *   run_setup.h        flags, model, recompute choice, memory plan, run identity
 *   run_checkpoints.h  parameters in (model file, init, resume) and out (checkpoints)
 *   run_eval.h         validation and sampling
 *   train_loop.h       the optimizer step, the loop, stop signals
 * Nothing here knows whether the device is a CPU or a GPU.
 */
#ifndef REMAT_TRAINER_H
#define REMAT_TRAINER_H

#include "backend.h"
#include "run_setup.h"
#include "run_checkpoints.h"
#include "run_eval.h"
#include "train_loop.h"

#endif
