/* Token shards: header, exact size, every token below the vocabulary size
 * (the first input byte picks V among a few). */
#include "dev/fuzz/fuzz_common.h"
#include "llmc/core/dataloader.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static const int vocab[4] = {2, 64, 65536, 70000};
    if (size < 1) return 0;
    fuzz_setup();
    int V = vocab[data[0] & 3];
    const char* path = fuzz_write_file(data + 1, size - 1);
    fuzz_last_open = NULL;
    if (setjmp(fuzz_jump)) { fuzz_close_left_open(); return 0; }
    uint32_t buf[7]; /* small: several reads per shard */
    int token_bytes;
    shard_validate(path, V, buf, sizeof(buf), 1, &token_bytes);
    fuzz_last_open = NULL;
    return 0;
}
