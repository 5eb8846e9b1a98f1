/* Model files, versions 3 (fp32) and 5 (bf16): header, size, then payload reads. */
#include "dev/fuzz/fuzz_common.h"
#include "llmc/core/model.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fuzz_setup();
    const char* path = fuzz_write_file(data, size);
    fuzz_last_open = NULL;
    if (setjmp(fuzz_jump)) { fuzz_close_left_open(); return 0; }
    ModelFileInfo info;
    FILE* f = model_file_open(path, &info);
    float chunk[64];
    size_t n = info.num_params < 32 ? info.num_params : 32; /* 32: the bf16 path stages in the upper half */
    model_file_read_at(f, &info, 0, chunk, n, path);
    model_file_read_at(f, &info, info.num_params - n, chunk, n, path);
    fclose(f);
    fuzz_last_open = NULL;
    return 0;
}
