/*
 * Token-shard dataloader (docs/FORMATS.md): GPT-2's shards (magic 20240520,
 * version 1, uint16 tokens) and llm.c's llama-3 shards (magic 20240801, version
 * 7, uint32 tokens), mixed freely: each shard's header says its token width.
 * The window holds tokens of 2 bytes while the vocabulary fits (V <= 65536: the
 * plan's bytes for GPT-2 unchanged) and of 4 beyond (loader_token_bytes); a
 * shard of the other width passes through a small buffer of the loader's own.
 *
 * A global batch is groups * B * T tokens; data-parallel group `group`
 * reads its own B*T+1 window of it, so N processes with batch B see exactly
 * the tokens of one process with batch N*B. Under context parallelism
 * (llmc/core/ring.h) the `group_size` ranks of a group share the window's B rows:
 * each row is cut into 2 group_size chunks of Tc = T / (2 group_size) tokens
 * and member p loads chunks p and 2 group_size - 1 - p (its B x 2Tc tokens,
 * row-major, the first chunk first): the causal mask gives every member the
 * same attention work. With documents under --reset-attention-mask it does
 * not, and each batch's chunks are paired to even it (ring_chunks_balance). Without it (group_size 1) a group is one rank and its rows are whole. Every shard is validated (header, exact size, every
 * token < V) when the loader opens, before any training; with several
 * processes each scans the tokens of its share of the shards, and an error
 * on any of them stops all (llmc/core/multiproc.h). A shard may change on disk
 * while training runs, so each (re)opening checks its header and size again
 * and every token of every batch is checked as it is loaded (B*T compares). Batches go in file
 * order by default; with shuffling, shard order and batch order inside each
 * shard are permuted per epoch from (seed, epoch), so a resumed run only
 * needs (epoch, shard position, batch position) to continue exactly.
 */
#ifndef REMAT_DATALOADER_H
#define REMAT_DATALOADER_H

#include <glob.h>
#include "utils.h"
#include "rand.h"
#include "token_layout.h" /* context_position */
#include "documents.h"
#include "loader_state.h"

#define SHARD_MAGIC 20240520     /* version 1: uint16 tokens */
#define SHARD_MAGIC_U32 20240801 /* version 7: uint32 tokens (llm.c's llama-3 shards) */

typedef struct {
    char** paths;
    size_t* num_tokens;
    int* token_bytes;      /* each shard's token width: 2 (version 1) or 4 (version 7) */
    size_t* batches;       /* global batches in each shard */
    int num_shards;
    int B, T, rank, world;
    int group, groups;     /* data-parallel: which global batch window is this rank's */
    int member, group_size; /* context-parallel: which chunks of each row */
    int vocab_size;        /* every token loaded is checked against it */
    int shuffle;
    uint64_t seed;
    /* position: the next batch is batch_order[batch_pos] of shard shard_order[shard_pos] */
    int epoch, shard_pos;
    size_t batch_pos;
    int* shard_order;
    size_t* batch_order;   /* NULL when not shuffling */
    size_t batch_order_cap;
    FILE* file;
    int open_shard;
    void* window;          /* B*T+1 tokens of window_bytes each (from the plan) */
    int window_bytes;      /* 2 or 4: loader_token_bytes(vocab_size) */
    unsigned char piece[4096]; /* a shard's tokens on their way into a window of the other width */
    int* inputs;           /* B*T (from the plan) */
    int* targets;
    int eot;               /* packed documents (llmc/core/documents.h): the token that starts one; -1: off */
    int* doc_start;        /* B*Tl: each loaded token's document start, a global position in its row (eot >= 0) */
    /* context parallelism with documents (eot >= 0, group_size N > 1): */
    int* chunk_start;      /* (B, 2N) the document start in force where each chunk of each row begins */
    int64_t* chunk_work;   /* (2N) the last batch's attended pairs of each chunk's queries, summed over its rows */
    int* chunk_order;      /* (2N) scratch of ring_chunks_balance */
    int* ring_chunks;      /* (2N) which chunks each member holds, chosen per batch (NULL: the zigzag; llmc/core/token_layout.h) */
} DataLoader;

/* i-th of tokens `bytes` wide (2: uint16, 4: uint32; little-endian, as the host). */
static inline uint32_t token_at(const void* tokens, int bytes, size_t i) {
    return bytes == 4 ? ((const uint32_t*)tokens)[i] : ((const uint16_t*)tokens)[i];
}

/* Reads and validates a shard header; returns the token count and, in
 * *token_bytes, the width of its tokens. */
static inline size_t shard_open_validate_header(FILE* f, const char* path, int* token_bytes) {
    int32_t h[256];
    if (fread(h, sizeof(int32_t), 256, f) != 256) fail("%s: too short for a token shard header (1024 bytes)", path);
    if (h[0] != SHARD_MAGIC && h[0] != SHARD_MAGIC_U32)
        fail("%s: bad magic %d (expected %d, or %d with uint32 tokens: not an llm.c token shard)", path, h[0], SHARD_MAGIC, SHARD_MAGIC_U32);
    int version = h[0] == SHARD_MAGIC ? 1 : 7;
    if (h[1] != version) fail("%s: unsupported shard version %d (magic %d has version %d)", path, h[1], h[0], version);
    if (h[2] < 0) fail("%s: negative token count %d in header", path, h[2]);
    *token_bytes = version == 1 ? 2 : 4;
    size_t n = (size_t)(uint32_t)h[2], actual = file_size_check(f, path), want = 1024 + (size_t)*token_bytes * n;
    if (actual != want)
        fail("%s: size %zu bytes does not match its header (expected %zu: %zu tokens of %d bytes)", path, actual, want, n, *token_bytes);
    return n;
}

/* Validation of one shard: header and size always; every token < vocab_size
 * when scan_tokens (with several processes each scans its share of shards).
 * buf: buf_bytes of scratch. */
static inline size_t shard_validate(const char* path, int vocab_size, void* buf, size_t buf_bytes, int scan_tokens, int* token_bytes) {
    FILE* f = fopen_check(path, "rb");
    size_t n = shard_open_validate_header(f, path, token_bytes);
    size_t buf_tokens = buf_bytes / (size_t)*token_bytes;
    for (size_t done = 0; scan_tokens && done < n;) {
        size_t k = n - done < buf_tokens ? n - done : buf_tokens;
        fread_check(buf, (size_t)*token_bytes, k, f, path);
        for (size_t i = 0; i < k; i++)
            if (token_at(buf, *token_bytes, i) >= (uint32_t)vocab_size)
                fail("%s: token %u at position %zu is out of range for vocabulary size %d", path, token_at(buf, *token_bytes, i), done + i,
                     vocab_size);
        done += k;
    }
    fclose(f);
    return n;
}

static inline void shuffle_indices_int(int* a, int n, uint64_t seed, uint64_t stream) {
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(rand_u64(seed, stream, (uint64_t)i) % (uint64_t)(i + 1));
        int t = a[i]; a[i] = a[j]; a[j] = t;
    }
}

static inline void shuffle_indices_size(size_t* a, size_t n, uint64_t seed, uint64_t stream) {
    for (size_t i = n - 1; i > 0 && n > 1; i--) {
        size_t j = (size_t)(rand_u64(seed, stream, (uint64_t)i) % (uint64_t)(i + 1));
        size_t t = a[i]; a[i] = a[j]; a[j] = t;
    }
}

/* Streams for the shuffle generator: distinct per epoch and shard. */
static inline uint64_t loader_stream(int epoch, int shard) { return 0x5348554600000000ULL ^ ((uint64_t)epoch << 24) ^ (uint64_t)shard; }

static inline int loader_current_shard(const DataLoader* dl) { return dl->shard_order[dl->shard_pos]; }

/* Lays out the epoch's shard order and the current shard's batch order. */
static inline void loader_prepare_position(DataLoader* dl) {
    for (int i = 0; i < dl->num_shards; i++) dl->shard_order[i] = i;
    if (dl->shuffle) shuffle_indices_int(dl->shard_order, dl->num_shards, dl->seed, loader_stream(dl->epoch, 0xffffff));
    if (!dl->shuffle) return;
    int s = loader_current_shard(dl);
    size_t nb = dl->batches[s];
    if (nb > dl->batch_order_cap) {
        free(dl->batch_order);
        dl->batch_order = (size_t*)malloc_check(nb * sizeof(size_t), "dataloader batch order");
        dl->batch_order_cap = nb;
    }
    for (size_t i = 0; i < nb; i++) dl->batch_order[i] = i;
    shuffle_indices_size(dl->batch_order, nb, dl->seed, loader_stream(dl->epoch, s));
}

/* Opens every shard matching `pattern`, validates all of them, and prepares
 * epoch 0. `staging` is scratch for validation reads (staging_bytes). T is the
 * whole sequence; with group_size > 1 this rank loads B x T / group_size
 * tokens. window: B*T+1 tokens of loader_token_bytes(vocab_size) bytes. */
static inline void dataloader_init(DataLoader* dl, const char* flag, const char* pattern, int B, int T, int rank, int world,
                                   int group, int groups, int member, int group_size, int vocab_size, int shuffle, uint64_t seed, void* window, int* inputs, int* targets,
                                   void* staging, size_t staging_bytes) {
    memset(dl, 0, sizeof(*dl));
    glob_t g;
    int rc = glob(pattern, 0, NULL, &g);
    if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) fail("%s: no files match '%s'", flag, pattern);
    if (rc != 0) fail("%s: cannot expand '%s'", flag, pattern);
    dl->num_shards = (int)g.gl_pathc;
    dl->paths = (char**)malloc_check(g.gl_pathc * sizeof(char*), "dataloader");
    dl->num_tokens = (size_t*)malloc_check(g.gl_pathc * sizeof(size_t), "dataloader");
    dl->token_bytes = (int*)malloc_check(g.gl_pathc * sizeof(int), "dataloader");
    dl->batches = (size_t*)malloc_check(g.gl_pathc * sizeof(size_t), "dataloader");
    dl->shard_order = (int*)malloc_check(g.gl_pathc * sizeof(int), "dataloader");
    dl->B = B; dl->T = T; dl->rank = rank; dl->world = world; dl->vocab_size = vocab_size;
    dl->group = group; dl->groups = groups; dl->member = member; dl->group_size = group_size;
    dl->shuffle = shuffle; dl->seed = seed;
    size_t global_tokens = (size_t)groups * (size_t)B * (size_t)T;
    for (int i = 0; i < dl->num_shards; i++) {
        dl->paths[i] = strdup(g.gl_pathv[i]);
        if (!dl->paths[i]) fail("out of host memory for the dataloader");
        dl->num_tokens[i] = shard_validate(dl->paths[i], vocab_size, staging, staging_bytes, i % world == rank, &dl->token_bytes[i]);
        if (dl->num_tokens[i] < global_tokens + 1)
            fail("%s: %zu tokens, too few for one batch of %d x %d x %d data-parallel groups + 1 tokens", dl->paths[i],
                 dl->num_tokens[i], B, T, groups);
        dl->batches[i] = (dl->num_tokens[i] - 1) / global_tokens;
    }
    globfree(&g);
    dl->window = window; dl->inputs = inputs; dl->targets = targets;
    dl->window_bytes = (int)loader_token_bytes(vocab_size);
    dl->open_shard = -1;
    dl->eot = -1;
    loader_prepare_position(dl);
}

static inline size_t dataloader_batches_per_epoch(const DataLoader* dl) {
    size_t total = 0;
    for (int i = 0; i < dl->num_shards; i++) total += dl->batches[i];
    return total;
}

/* Opens shard s for reading batches, checking again that it is the shard
 * validated at start (same header, same token count). */
static inline void loader_reopen(DataLoader* dl, int s) {
    if (dl->file) fclose(dl->file);
    dl->file = fopen_check(dl->paths[s], "rb");
    dl->open_shard = s;
    int token_bytes;
    size_t n = shard_open_validate_header(dl->file, dl->paths[s], &token_bytes);
    if (n != dl->num_tokens[s])
        fail("%s: now holds %zu tokens, %zu when training started (the shard changed on disk)", dl->paths[s], n, dl->num_tokens[s]);
    if (token_bytes != dl->token_bytes[s])
        fail("%s: now holds tokens of %d bytes, %d when training started (the shard changed on disk)", dl->paths[s], token_bytes,
             dl->token_bytes[s]);
}

static inline void loader_bad_token(const DataLoader* dl, int s, uint32_t token, size_t position) {
    fail("%s: token %u at position %zu is out of range for vocabulary size %d (the shard changed on disk after it was validated)",
         dl->paths[s], token, position, dl->vocab_size);
}

/* count tokens of the open shard, from position `start` (the file is there),
 * into the window, whose tokens are of the other width: through dl->piece,
 * each checked before it is narrowed. */
static inline void loader_read_converting(DataLoader* dl, int s, size_t start, size_t count) {
    int w = dl->token_bytes[s];
    size_t per_piece = sizeof(dl->piece) / (size_t)w;
    for (size_t done = 0; done < count;) {
        size_t k = count - done < per_piece ? count - done : per_piece;
        fread_check(dl->piece, (size_t)w, k, dl->file, dl->paths[s]);
        for (size_t i = 0; i < k; i++) {
            uint32_t t = token_at(dl->piece, w, i);
            if (t >= (uint32_t)dl->vocab_size) loader_bad_token(dl, s, t, start + done + i);
            if (dl->window_bytes == 4) ((uint32_t*)dl->window)[done + i] = t;
            else ((uint16_t*)dl->window)[done + i] = (uint16_t)t;
        }
        done += k;
    }
}

/* Reads tokens [start, start + n] of the open shard into the window (n + 1
 * tokens: the last is the target of the n-th), checking each. */
static inline void loader_read(DataLoader* dl, int s, size_t start, size_t n) {
    int w = dl->token_bytes[s];
    fseek_check(dl->file, (long)(1024 + (size_t)w * start), SEEK_SET, dl->paths[s]);
    if (w != dl->window_bytes) {
        loader_read_converting(dl, s, start, n + 1);
        return;
    }
    fread_check(dl->window, (size_t)w, n + 1, dl->file, dl->paths[s]);
    for (size_t i = 0; i <= n; i++)
        if (token_at(dl->window, w, i) >= (uint32_t)dl->vocab_size) loader_bad_token(dl, s, token_at(dl->window, w, i), start + i);
}

/* The window's i-th token. */
static inline int window_token(const DataLoader* dl, size_t i) { return (int)token_at(dl->window, dl->window_bytes, i); }

/* Every loaded token's document start from here on (llmc/core/documents.h):
 * the loader builds them from the tokens, so that a context-parallel rank
 * knows where a document that began in another rank's chunk started. With
 * ring_chunks (2N ints: the ring with --reset-attention-mask) it also pairs
 * each batch's chunks so that the members' attended pairs are as equal as
 * they can be (ring_chunks_balance), and writes the pairing there. */
static inline void dataloader_documents(DataLoader* dl, int eot, int* doc_start, int* ring_chunks) {
    dl->eot = eot;
    dl->doc_start = doc_start;
    if (dl->group_size <= 1) return; /* <= : -x 0 leaves the training loader unopened */
    size_t n = 2 * (size_t)dl->group_size;
    dl->chunk_start = (int*)malloc_check((size_t)dl->B * n * sizeof(int), "the dataloader's chunk starts");
    dl->chunk_work = (int64_t*)malloc_check(n * sizeof(int64_t), "the dataloader's chunk work");
    dl->chunk_order = (int*)malloc_check(n * sizeof(int), "the dataloader's chunk work");
    dl->ring_chunks = ring_chunks;
    for (size_t c = 0; ring_chunks && c < n; c++) ring_chunks[c] = ring_chunk(NULL, dl->group_size, (int)(c / 2), (int)(c % 2));
}

/* With documents, every chunk of each of the window's rows, read once before
 * this rank's own: the document start in force where each chunk begins, and
 * each chunk's attended pairs, from which the chunks are paired (a row's
 * tokens once more: a fraction of a step's work). */
static inline void loader_scan_documents(DataLoader* dl, int s, size_t window_start) {
    int N = dl->group_size, Tc = dl->T / (2 * N);
    for (int c = 0; c < 2 * N; c++) dl->chunk_work[c] = 0;
    for (size_t b = 0; b < (size_t)dl->B; b++) {
        int cur = 0;
        for (int c = 0; c < 2 * N; c++) {
            dl->chunk_start[b * 2 * (size_t)N + (size_t)c] = cur;
            loader_read(dl, s, window_start + b * (size_t)dl->T + (size_t)c * Tc, (size_t)Tc);
            int64_t work = 0;
            for (int i = 0, p = c * Tc; i < Tc; i++, p++) {
                if (window_token(dl, (size_t)i) == dl->eot) cur = p;
                work += p - cur + 1;
            }
            dl->chunk_work[c] += work;
        }
    }
    if (dl->ring_chunks) ring_chunks_balance(dl->ring_chunks, dl->chunk_order, dl->chunk_work, N);
}

/* This rank's chunks of each of the window's B rows (see the top; with
 * documents, those ring_chunks pairs it). */
static inline void loader_read_chunks(DataLoader* dl, int s, size_t window_start) {
    int N = dl->group_size;
    size_t Tc = (size_t)dl->T / (2 * (size_t)N), Tl = 2 * Tc;
    if (dl->eot >= 0) loader_scan_documents(dl, s, window_start);
    for (size_t b = 0; b < (size_t)dl->B; b++)
        for (int k = 0; k < 2; k++) {
            size_t chunk = (size_t)ring_chunk(dl->ring_chunks, N, dl->member, k), at = b * Tl + (size_t)k * Tc;
            loader_read(dl, s, window_start + b * (size_t)dl->T + chunk * Tc, Tc);
            for (size_t i = 0; i < Tc; i++) {
                dl->inputs[at + i] = window_token(dl, i);
                dl->targets[at + i] = window_token(dl, i + 1);
            }
            if (dl->eot >= 0)
                document_starts_extend(dl->doc_start + at, dl->inputs + at, (int)Tc, (int)(chunk * Tc),
                                       dl->chunk_start[b * 2 * (size_t)N + chunk], dl->eot);
        }
}

/* Loads the next batch into inputs/targets and advances, wrapping epochs. */
static inline void dataloader_next(DataLoader* dl) {
    int s = loader_current_shard(dl);
    size_t batch = dl->shuffle ? dl->batch_order[dl->batch_pos] : dl->batch_pos;
    size_t BT = (size_t)dl->B * (size_t)dl->T;
    size_t start = batch * BT * (size_t)dl->groups + (size_t)dl->group * BT;
    if (dl->open_shard != s) loader_reopen(dl, s);
    if (dl->group_size > 1) {
        loader_read_chunks(dl, s, start);
    } else {
        loader_read(dl, s, start, BT);
        for (size_t i = 0; i < BT; i++) {
            dl->inputs[i] = window_token(dl, i);
            dl->targets[i] = window_token(dl, i + 1);
        }
        for (size_t b = 0; dl->eot >= 0 && b < (size_t)dl->B; b++)
            document_starts_extend(dl->doc_start + b * dl->T, dl->inputs + b * dl->T, dl->T, 0, 0, dl->eot);
    }
    if (++dl->batch_pos < dl->batches[s]) return;
    dl->batch_pos = 0;
    if (++dl->shard_pos == dl->num_shards) { dl->shard_pos = 0; dl->epoch++; }
    loader_prepare_position(dl);
}

static inline void dataloader_reset(DataLoader* dl) {
    dl->epoch = 0; dl->shard_pos = 0; dl->batch_pos = 0;
    loader_prepare_position(dl);
}

static inline DataLoaderState dataloader_get_state(const DataLoader* dl) {
    DataLoaderState st = {dl->epoch, dl->shard_pos, (int64_t)dl->batch_pos};
    return st;
}

static inline void dataloader_set_state(DataLoader* dl, DataLoaderState st, const char* what) {
    if (st.epoch < 0 || st.shard_pos < 0 || st.shard_pos >= dl->num_shards || st.batch_pos < 0)
        fail("%s: dataloader position does not fit the current shards", what);
    dl->epoch = st.epoch; dl->shard_pos = st.shard_pos;
    loader_prepare_position(dl);
    if ((size_t)st.batch_pos >= dl->batches[loader_current_shard(dl)])
        fail("%s: dataloader position does not fit the current shards", what);
    dl->batch_pos = (size_t)st.batch_pos;
}

static inline void dataloader_free(DataLoader* dl) {
    if (dl->file) fclose(dl->file);
    for (int i = 0; i < dl->num_shards; i++) free(dl->paths[i]);
    free(dl->paths); free(dl->num_tokens); free(dl->token_bytes); free(dl->batches); free(dl->shard_order); free(dl->batch_order);
    free(dl->chunk_start); free(dl->chunk_work); free(dl->chunk_order);
    memset(dl, 0, sizeof(*dl));
}

#endif
