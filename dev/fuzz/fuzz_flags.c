/* The flag parser: the input, split at NUL bytes, is argv; then the layer
 * set of --recompute-layers over 1..64 layers (the first byte) and the byte
 * size of --mem-budget, as the trainer parses them. */
#include "dev/fuzz/fuzz_common.h"
#include "llmc/core/cli.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1 || size > 4096) return 0;
    fuzz_setup();
    static char buf[4098];
    memcpy(buf, data + 1, size - 1);
    buf[size - 1] = '\0';
    char* argv[66] = {"train_gpt"};
    int argc = 1;
    for (char* p = buf; p < buf + size - 1 && argc < 65; p += strlen(p) + 1) {
        if (strcmp(p, "-h") == 0 || strcmp(p, "--help") == 0) return 0; /* prints help and exits 0 by design */
        argv[argc++] = p;
    }
    int L = 1 + data[0] % 64;
    if (setjmp(fuzz_jump)) return 0;
    TrainOptions o;
    parse_args(argc, argv, &o, FOR_BOTH);
    static unsigned char* mask;
    free(mask); /* from the last input, when it jumped out */
    mask = (unsigned char*)malloc((size_t)L); /* exactly L bytes: ASan sees any write past them */
    parse_layer_set(o.recompute_layers, L, mask);
    for (int l = 0; l < L; l++)
        if (mask[l] > 1) abort();
    parse_bytes("--mem-budget", o.mem_budget);
    return 0;
}
