/*
 * Where the data loader stands: what a state file records (core/checkpoint.h)
 * and a resume restores (core/dataloader.h), apart from both so that the
 * checkpoint files do not depend on the loader; and the width of the tokens
 * its window holds, which the memory plan sizes.
 */
#ifndef REMAT_LOADER_STATE_H
#define REMAT_LOADER_STATE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int epoch, shard_pos; /* the epoch, and the shard within it */
    int64_t batch_pos;    /* the next batch, in the shard's batch order */
} DataLoaderState;

/* Bytes of each token in the loader's window: 2 while every token id fits in
 * uint16 (V <= 65536, GPT-2's plan unchanged), 4 beyond. */
static inline size_t loader_token_bytes(int vocab_size) { return vocab_size > 65536 ? 4 : 2; }

#endif
