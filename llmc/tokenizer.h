/*
 * Tokenizer file reader (FORMATS.md: magic 20240328, version 1 or 2), for
 * decoding samples only. A missing file is not an error: samples are then
 * printed as token ids.
 */
#ifndef REMAT_TOKENIZER_H
#define REMAT_TOKENIZER_H

#include "utils.h"

#define TOKENIZER_MAGIC 20240328

typedef struct {
    int vocab_size;
    int eot_token;
    char** tokens;   /* token bytes, NUL-terminated for convenience */
    unsigned char* lengths; /* bytes per token: a token may itself hold a NUL byte */
    int loaded;
} Tokenizer;

static inline void tokenizer_load(Tokenizer* tk, const char* path) {
    memset(tk, 0, sizeof(*tk));
    FILE* f = fopen_check(path, "rb");
    uint32_t h[256];
    if (fread(h, sizeof(uint32_t), 256, f) != 256) fail("%s: too short for a tokenizer header (1024 bytes)", path);
    if (h[0] != TOKENIZER_MAGIC) fail("%s: bad magic %u (expected %d: not a tokenizer file)", path, h[0], TOKENIZER_MAGIC);
    if (h[1] != 1 && h[1] != 2) fail("%s: unsupported tokenizer version %u (expected 1 or 2)", path, h[1]);
    if (h[2] < 1 || h[2] > 1000000) fail("%s: vocabulary size %u out of range", path, h[2]);
    tk->vocab_size = (int)h[2];
    if (h[1] == 2 && h[3] >= h[2])
        fail("%s: end-of-text token %u out of range [0, %u) (the vocabulary size)", path, h[3], h[2]);
    if (h[1] == 1 && h[2] <= 50256) fail("%s: version 1 implies end-of-text token 50256, but the vocabulary has %u tokens", path, h[2]);
    tk->eot_token = h[1] == 1 ? 50256 : (int)h[3];
    tk->tokens = (char**)calloc_check((size_t)tk->vocab_size, sizeof(char*), "tokenizer");
    tk->lengths = (unsigned char*)calloc_check((size_t)tk->vocab_size, 1, "tokenizer");
    for (int i = 0; i < tk->vocab_size; i++) {
        unsigned char len;
        fread_check(&len, 1, 1, f, path);
        if (len == 0) fail("%s: token %d has length 0", path, i);
        tk->tokens[i] = (char*)malloc_check((size_t)len + 1, "tokenizer");
        fread_check(tk->tokens[i], 1, len, f, path);
        tk->tokens[i][len] = '\0';
        tk->lengths[i] = len;
    }
    if (fgetc(f) != EOF) fail("%s: trailing bytes after %d tokens", path, tk->vocab_size);
    fclose(f);
    tk->loaded = 1;
}

/* The token's bytes, or NULL when the token is unknown or no file was loaded. */
static inline const char* tokenizer_decode(const Tokenizer* tk, int token) {
    if (!tk->loaded || token < 0 || token >= tk->vocab_size) return NULL;
    return tk->tokens[token];
}

/* Prints a token for a human: raw bytes unless it is a lone control byte. */
static inline void tokenizer_print(const Tokenizer* tk, int token, FILE* out) {
    const char* s = tokenizer_decode(tk, token);
    if (!s) { fprintf(out, "<%d>", token); return; }
    if (tk->lengths[token] == 1) {
        unsigned char c = (unsigned char)s[0];
        if (c < 32 && c != '\n' && c != '\t' && c != '\r') { fprintf(out, "<%d>", token); return; }
    }
    fwrite(s, 1, tk->lengths[token], out);
}

static inline void tokenizer_free(Tokenizer* tk) {
    if (tk->tokens)
        for (int i = 0; i < tk->vocab_size; i++) free(tk->tokens[i]);
    free(tk->tokens);
    free(tk->lengths);
    memset(tk, 0, sizeof(*tk));
}

#endif
