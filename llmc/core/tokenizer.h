/*
 * Tokenizer file reader (docs/FORMATS.md: magic 20240328, version 1 or 2), for
 * decoding samples; prompts are token ids (below). A missing file is not an
 * error: samples are then printed as token ids.
 */
#ifndef REMAT_TOKENIZER_H
#define REMAT_TOKENIZER_H

#include <sys/wait.h>
#include <unistd.h>
#include "utils.h"

#define TOKENIZER_MAGIC 20240328

typedef struct {
    int vocab_size;
    int eot_token;
    char** tokens;   /* token bytes, NUL-terminated for convenience */
    unsigned char* lengths; /* bytes per token: a token may itself hold a NUL byte */
    int loaded;
    char path[4096];
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
    snprintf(tk->path, sizeof(tk->path), "%s", path);
}

/* The token's bytes, or NULL when the token is unknown or no file was loaded. */
static inline const char* tokenizer_decode(const Tokenizer* tk, int token) {
    if (!tk->loaded || token < 0 || token >= tk->vocab_size) return NULL;
    return tk->tokens[token];
}

/* ---- printing samples as valid UTF-8 ----
 * A multi-byte character may be split across tokens (GPT-2's byte-level BPE
 * does this), so bytes wait in `pending` until their character is complete;
 * a byte that cannot be part of valid UTF-8 prints as U+FFFD. */

typedef struct {
    unsigned char pending[4];
    int have, need; /* bytes held, bytes the held character needs */
} Utf8Stream;

#define UTF8_REPLACEMENT "\xEF\xBF\xBD"

/* Length of the character a lead byte starts (1-4), 0 if it cannot start one. */
static inline int utf8_lead_length(unsigned char b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4;
    return 0;
}

/* Whether b may follow the held bytes: continuation bytes, with the second
 * byte's narrower ranges that exclude overlong forms, surrogates and > U+10FFFF. */
static inline int utf8_continues(const Utf8Stream* s, unsigned char b) {
    if (s->have == 1) {
        switch (s->pending[0]) {
        case 0xE0: return b >= 0xA0 && b <= 0xBF;
        case 0xED: return b >= 0x80 && b <= 0x9F;
        case 0xF0: return b >= 0x90 && b <= 0xBF;
        case 0xF4: return b >= 0x80 && b <= 0x8F;
        default: break;
        }
    }
    return b >= 0x80 && b <= 0xBF;
}

static inline void utf8_put_byte(Utf8Stream* s, unsigned char b, FILE* out) {
    if (s->have > 0) {
        if (utf8_continues(s, b)) {
            s->pending[s->have++] = b;
            if (s->have == s->need) { fwrite(s->pending, 1, (size_t)s->have, out); s->have = 0; }
            return;
        }
        fputs(UTF8_REPLACEMENT, out); /* the held character never completed */
        s->have = 0;
    }
    int len = utf8_lead_length(b);
    if (len == 1) fputc(b, out);
    else if (len == 0) fputs(UTF8_REPLACEMENT, out);
    else { s->pending[0] = b; s->have = 1; s->need = len; }
}

/* At the end of a sample: a character still incomplete prints as U+FFFD. */
static inline void utf8_finish(Utf8Stream* s, FILE* out) {
    if (s->have > 0) fputs(UTF8_REPLACEMENT, out);
    s->have = 0;
}

/* Prints a token for a human: its bytes through the UTF-8 stream, or <id>
 * when it is unknown, or a lone control byte. */
static inline void tokenizer_print(const Tokenizer* tk, int token, Utf8Stream* s, FILE* out) {
    const char* text = tokenizer_decode(tk, token);
    unsigned char c0 = text ? (unsigned char)text[0] : 0;
    if (!text || (tk->lengths[token] == 1 && c0 < 32 && c0 != '\n' && c0 != '\t' && c0 != '\r')) {
        utf8_finish(s, out);
        fprintf(out, "<%d>", token);
        return;
    }
    for (int i = 0; i < tk->lengths[token]; i++) utf8_put_byte(s, (unsigned char)text[i], out);
}

/* ---- prompts ----
 * A prompt is token ids. --prompt-tokens FILE reads them from a token shard
 * (docs/FORMATS.md) or a text file of ids separated by spaces, commas or newlines,
 * which needs nothing but the trainer. --prompt TEXT runs the helper
 * dev/data/prompt.py (beside the trainer binary) with python3, which prints
 * the ids of TEXT in the tokenizer's vocabulary. */

typedef struct {
    int* ids;
    int n;
} Prompt;

/* Ids in text: numbers separated by whitespace or commas. */
static inline void prompt_parse_ids(Prompt* p, const char* text, size_t len, const char* what) {
    size_t cap = 64;
    p->ids = (int*)malloc_check(cap * sizeof(int), "prompt");
    p->n = 0;
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)text[i];
        if (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r') { i++; continue; }
        if (c < '0' || c > '9') fail("%s: byte %zu ('%c') is not part of a token id (ids separated by spaces or commas)", what, i, c >= 32 && c < 127 ? c : '?');
        long v = 0;
        while (i < len && text[i] >= '0' && text[i] <= '9') {
            v = v * 10 + (text[i++] - '0');
            if (v > 2147483647L) fail("%s: token id above 2147483647 (token ids are int32)", what);
        }
        if ((size_t)p->n == cap) p->ids = (int*)realloc(p->ids, (cap *= 2) * sizeof(int));
        if (!p->ids) fail("out of memory reading %s", what);
        p->ids[p->n++] = (int)v;
    }
    if (p->n == 0) fail("%s: no token ids", what);
}

static inline void prompt_load_file(Prompt* p, const char* path) {
    FILE* f = fopen_check(path, "rb");
    size_t size = file_size_check(f, path);
    char* buf = (char*)malloc_check(size + 1, "prompt");
    fread_check(buf, 1, size, f, path);
    fclose(f);
    int32_t magic = 0;
    if (size >= 4) memcpy(&magic, buf, 4);
    if (magic == 20240520 || magic == 20240801) { /* a token shard: version 1 (uint16 tokens) or 7 (uint32) */
        int32_t h[3];
        int version = magic == 20240520 ? 1 : 7;
        size_t width = version == 1 ? 2 : 4;
        if (size < 1024) fail("%s: too short for a token shard header (1024 bytes)", path);
        memcpy(h, buf, sizeof(h));
        if (h[1] != version || h[2] < 1 || size != 1024 + width * (size_t)h[2])
            fail("%s: not a valid version-%d token shard (header and size disagree, or no tokens)", path, version);
        p->n = h[2];
        p->ids = (int*)malloc_check((size_t)p->n * sizeof(int), "prompt");
        for (int i = 0; i < p->n; i++) {
            uint32_t t = 0; /* little-endian, as the host */
            memcpy(&t, buf + 1024 + width * (size_t)i, width);
            if (t > 2147483647u) fail("%s: token %u at position %d is above 2147483647 (token ids are int32)", path, t, i);
            p->ids[i] = (int)t;
        }
    } else {
        prompt_parse_ids(p, buf, size, path);
    }
    free(buf);
}

/* Runs python3 HELPER [--tokenizer FILE] -- TEXT without a shell and reads its ids. */
static inline void prompt_from_helper(Prompt* p, const char* text, const char* tokenizer_path) {
    char exe[4096], helper[4200];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) fail("--prompt: cannot find the trainer's own directory to locate dev/data/prompt.py");
    exe[n] = '\0';
    char* slash = strrchr(exe, '/');
    if (slash) *slash = '\0';
    snprintf(helper, sizeof(helper), "%s/dev/data/prompt.py", exe);
    if (!file_exists(helper)) fail("--prompt: %s not found (give --prompt-tokens FILE instead)", helper);
    const char* argv[8] = {"python3", helper, "--tokenizer", tokenizer_path, "--", text, NULL};
    if (!tokenizer_path) { argv[2] = "--"; argv[3] = text; argv[4] = NULL; }
    int fd[2];
    if (pipe(fd) != 0) fail("--prompt: pipe failed (%s)", strerror(errno));
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) fail("--prompt: fork failed (%s)", strerror(errno));
    if (pid == 0) {
        dup2(fd[1], 1);
        close(fd[0]);
        close(fd[1]);
        execvp("python3", (char* const*)argv);
        _exit(127);
    }
    close(fd[1]);
    size_t cap = 4096, len = 0;
    char* out = (char*)malloc_check(cap, "prompt");
    ssize_t got;
    while ((got = read(fd[0], out + len, cap - len)) > 0) {
        len += (size_t)got;
        if (len == cap && !(out = (char*)realloc(out, cap *= 2))) fail("out of memory reading the prompt helper");
    }
    close(fd[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
        fail("--prompt: could not run python3 to tokenize the prompt (on a machine without Python give --prompt-tokens FILE)");
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail("--prompt: the tokenizer helper %s failed (its message is above)", helper);
    prompt_parse_ids(p, out, len, "--prompt (the helper's output)");
    free(out);
}

static inline void prompt_free(Prompt* p) {
    free(p->ids);
    memset(p, 0, sizeof(*p));
}

static inline void tokenizer_free(Tokenizer* tk) {
    if (tk->tokens)
        for (int i = 0; i < tk->vocab_size; i++) free(tk->tokens[i]);
    free(tk->tokens);
    free(tk->lengths);
    memset(tk, 0, sizeof(*tk));
}

#endif
