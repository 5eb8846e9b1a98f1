/* Tokenizer files, versions 1 and 2: header fields, token table, then
 * decoding every id around the table's ends and the end-of-text token. */
#include "dev/fuzz/fuzz_common.h"
#include "llmc/core/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    static Tokenizer tk;
    fuzz_setup();
    const char* path = fuzz_write_file(data, size);
    fuzz_last_open = NULL;
    if (setjmp(fuzz_jump)) { fuzz_close_left_open(); tokenizer_free(&tk); return 0; }
    tokenizer_load(&tk, path);
    fuzz_last_open = NULL;
    FILE* sink = fopen("/dev/null", "w");
    const int ids[5] = {-1, 0, tk.vocab_size - 1, tk.vocab_size, tk.eot_token};
    Utf8Stream utf8;
    memset(&utf8, 0, sizeof(utf8));
    for (int i = 0; i < 5; i++) tokenizer_print(&tk, ids[i], &utf8, sink);
    utf8_finish(&utf8, sink);
    if (tk.eot_token < 0 || tk.eot_token >= tk.vocab_size) abort(); /* the loader must have refused it */
    fclose(sink);
    tokenizer_free(&tk);
    return 0;
}
