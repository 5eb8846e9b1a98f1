/*
 * Shared by the libFuzzer harnesses (built by `make fuzz` with clang under
 * ASan + UBSan, run for a bounded time by dev/test/test_fuzz.py).
 *
 * The parsers report bad input through fail(), which exits; here its hook
 * jumps back into the harness instead, so a refused input is a normal
 * outcome and only a crash, a sanitizer report or a hang is a finding. A
 * parser that fails leaves the file it was reading open: the harness closes
 * it (each parser opens one file at a time).
 */
#ifndef REMAT_FUZZ_COMMON_H
#define REMAT_FUZZ_COMMON_H

#include <setjmp.h>
#include <stdint.h>
#include <stddef.h>
#include "llmc/core/utils.h"

static jmp_buf fuzz_jump;
static FILE* fuzz_last_open;
static char fuzz_path[64];

static void fuzz_on_fail(void) { longjmp(fuzz_jump, 1); }
static void fuzz_on_fopen(FILE* f) { fuzz_last_open = f; }

static inline void fuzz_setup(void) {
    remat_fail_hook = fuzz_on_fail;
    remat_fail_quiet = 1;
    remat_fopen_hook = fuzz_on_fopen;
    if (!fuzz_path[0]) /* memory-backed when there is one: the harness rewrites it for every input */
        snprintf(fuzz_path, sizeof(fuzz_path), "%s/remat_fuzz_%d.bin", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (int)getpid());
}

/* The input as a file at fuzz_path, for the parsers that read files. */
static inline const char* fuzz_write_file(const uint8_t* data, size_t size) {
    FILE* f = fopen(fuzz_path, "wb");
    if (!f || fwrite(data, 1, size, f) != size || fclose(f) != 0) abort();
    return fuzz_path;
}

/* After a parser jumped out: the file it left open. */
static inline void fuzz_close_left_open(void) {
    if (fuzz_last_open) fclose(fuzz_last_open);
    fuzz_last_open = NULL;
}

#endif
