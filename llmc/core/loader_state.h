/*
 * Where the data loader stands: what a state file records (core/checkpoint.h)
 * and a resume restores (core/dataloader.h), apart from both so that the
 * checkpoint files do not depend on the loader.
 */
#ifndef REMAT_LOADER_STATE_H
#define REMAT_LOADER_STATE_H

#include <stdint.h>

typedef struct {
    int epoch, shard_pos; /* the epoch, and the shard within it */
    int64_t batch_pos;    /* the next batch, in the shard's batch order */
} DataLoaderState;

#endif
