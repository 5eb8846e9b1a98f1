/* The checkpoint directory scan: file names (DONE_, model_, state_), the DONE
 * marker's text, and the log lines a resume keeps. */
#include "dev/fuzz/fuzz_common.h"
#include "llmc/core/checkpoint.h"
#include "llmc/run/logger.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fuzz_setup();
    char text[512];
    size_t n = size < sizeof(text) - 1 ? size : sizeof(text) - 1;
    memcpy(text, data, n);
    text[n] = '\0';
    if (setjmp(fuzz_jump)) return 0;
    const char* kinds[3][2] = {{"DONE", ""}, {"model", ".bin"}, {"state", ""}};
    for (int k = 0; k < 3; k++) {
        int step = checkpoint_step_of_name(text, kinds[k][0], kinds[k][1]);
        if (step < -1 || step > 99999999) abort();
    }
    uint64_t id;
    checkpoint_parse_marker((const char*)data, size, &id);
    logger_line_kept(text, strlen(text), 5);
    return 0;
}
