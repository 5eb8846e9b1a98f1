/* Training-state files: header fields and size against the header. */
#include "dev/fuzz/fuzz_common.h"
#include "llmc/core/checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fuzz_setup();
    const char* path = fuzz_write_file(data, size);
    fuzz_last_open = NULL;
    if (setjmp(fuzz_jump)) { fuzz_close_left_open(); return 0; }
    TrainState st;
    FILE* f = state_open(path, &st);
    fuzz_last_open = NULL;
    float x[8];
    size_t n = st.shard_params < 8 ? st.shard_params : 8;
    if (fread(x, 4, n, f) != n) abort(); /* the size check promised the payload */
    fclose(f);
    return 0;
}
