/*
 * Reads token shards and tokenizer files through the trainers' own loader
 * code (llmc/core/dataloader.h, llmc/core/tokenizer.h) and prints what it read, so the
 * Python tests can check that C reads exactly what Python wrote.
 *   read_data shards GLOB B T V [shuffle seed]   one line per batch of one epoch
 *   read_data tokenizer PATH                     "eot N", then "id hex" per token
 */
#include "../../llmc/core/dataloader.h"
#include "../../llmc/core/tokenizer.h"

static int dump_shards(const char* pattern, int B, int T, int V, int shuffle, int seed) {
    size_t BT = (size_t)B * T;
    void* window = malloc_check((BT + 1) * loader_token_bytes(V), "window");
    int* inputs = (int*)malloc_check(BT * sizeof(int), "inputs");
    int* targets = (int*)malloc_check(BT * sizeof(int), "targets");
    uint16_t staging[4096]; /* 8 KiB: several reads per shard */
    DataLoader dl;
    dataloader_init(&dl, "shards", pattern, B, T, 0, 1, 0, 1, 0, 1, V, shuffle, (uint64_t)seed, window, inputs, targets, staging, sizeof(staging));
    size_t n = dataloader_batches_per_epoch(&dl);
    printf("shards %d batches %zu\n", dl.num_shards, n);
    for (size_t b = 0; b < n; b++) {
        dataloader_next(&dl);
        printf("inputs");
        for (size_t i = 0; i < BT; i++) printf(" %d", inputs[i]);
        printf("\ntargets");
        for (size_t i = 0; i < BT; i++) printf(" %d", targets[i]);
        printf("\n");
    }
    printf("epoch after %d\n", dl.epoch);
    dataloader_free(&dl);
    free(window); free(inputs); free(targets);
    return 0;
}

static int dump_tokenizer(const char* path) {
    Tokenizer tk;
    tokenizer_load(&tk, path);
    printf("eot %d\nvocab %d\n", tk.eot_token, tk.vocab_size);
    for (int i = 0; i < tk.vocab_size; i++) {
        printf("%d ", i);
        const unsigned char* p = (const unsigned char*)tokenizer_decode(&tk, i);
        for (int k = 0; k < tk.lengths[i]; k++) printf("%02x", p[k]);
        printf("\n");
    }
    tokenizer_free(&tk);
    return 0;
}

int main(int argc, char** argv) {
    if (argc >= 6 && strcmp(argv[1], "shards") == 0)
        return dump_shards(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), argc > 6 ? atoi(argv[6]) : 0, argc > 7 ? atoi(argv[7]) : 0);
    if (argc == 3 && strcmp(argv[1], "tokenizer") == 0) return dump_tokenizer(argv[2]);
    fprintf(stderr, "usage: read_data shards GLOB B T V [shuffle seed] | read_data tokenizer PATH\n");
    return 2;
}
