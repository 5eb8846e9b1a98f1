/*
 * Error handling and checked I/O shared by both trainers.
 *
 * One error path: every failure goes through fail(), which prints a single
 * line "error: <what>: <why>" to stderr and exits non-zero. Checked wrappers
 * name the file they were working on, so a user never sees a bare errno.
 */
#ifndef REMAT_UTILS_H
#define REMAT_UTILS_H

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Called by fail() before exit; the multi-process build installs a hook that
 * brings down every rank, so an error on one never leaves the others hanging. */
typedef void (*fail_hook_fn)(void);
static fail_hook_fn remat_fail_hook = NULL;
/* Rank named in error lines of multi-process runs; -1 for a single process. */
static int remat_error_rank = -1;
/* For the fuzz harnesses (dev/fuzz), whose fail hook jumps back out of a
 * parser: no error line per input, and each file opened is reported so the
 * harness can close the one a failing parser leaves open. */
static int remat_fail_quiet = 0;
static void (*remat_fopen_hook)(FILE* f) = NULL;

#if defined(__GNUC__)
#define REMAT_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define REMAT_PRINTF(a, b)
#endif

/* The temporary file of the atomic write under way (see atomic_open), or
 * "": fail() removes it, so an error mid-write leaves the file absent, never
 * a partial one under any name. */
static char remat_pending_tmp[4200] = "";

static inline void fail(const char* fmt, ...) REMAT_PRINTF(1, 2);
static inline void fail(const char* fmt, ...) {
    /* formatted whole, then written at once, so lines from several ranks never mix */
    char line[2048];
    int used = remat_error_rank >= 0 ? snprintf(line, sizeof(line), "error: rank %d: ", remat_error_rank)
                                     : snprintf(line, sizeof(line), "error: ");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + used, sizeof(line) - (size_t)used - 1, fmt, ap);
    va_end(ap);
    size_t len = strlen(line);
    line[len] = '\n';
    fflush(stdout);
    if (!remat_fail_quiet && write(STDERR_FILENO, line, len + 1) < 0) { /* nothing left to report to */ }
    if (remat_pending_tmp[0]) remove(remat_pending_tmp);
    remat_pending_tmp[0] = '\0';
    if (remat_fail_hook) remat_fail_hook();
    exit(1);
}

static inline void* malloc_check(size_t bytes, const char* what) {
    void* p = malloc(bytes ? bytes : 1);
    if (!p) fail("out of host memory allocating %zu bytes for %s", bytes, what);
    return p;
}

static inline void* calloc_check(size_t n, size_t size, const char* what) {
    void* p = calloc(n ? n : 1, size ? size : 1);
    if (!p) fail("out of host memory allocating %zu x %zu bytes for %s", n, size, what);
    return p;
}

static inline FILE* fopen_check(const char* path, const char* mode) {
    FILE* f = fopen(path, mode);
    if (!f) fail("%s: cannot open (%s)", path, strerror(errno));
    if (remat_fopen_hook) remat_fopen_hook(f);
    return f;
}

static inline void fread_check(void* dst, size_t size, size_t n, FILE* f, const char* path) {
    size_t got = fread(dst, size, n, f);
    if (got != n) {
        if (ferror(f)) fail("%s: read failed (%s)", path, strerror(errno));
        fail("%s: truncated file (expected %zu more bytes)", path, (n - got) * size);
    }
}

/* Why a write failed, in words; EFBIG names the limit that causes it. */
static inline const char* write_error_why(int err) {
    return err == EFBIG ? "file too large: the file size limit (ulimit -f) is reached" : strerror(err);
}

/* A process over its file size limit (RLIMIT_FSIZE) is killed by SIGXFSZ
 * unless it ignores the signal; ignored, the write fails with EFBIG, which
 * the checked writes turn into one line naming the file. Called first
 * thing by both trainers (before MPI_Init, which writes files too). */
static inline void ignore_file_size_signal(void) { signal(SIGXFSZ, SIG_IGN); }

static inline void fwrite_check(const void* src, size_t size, size_t n, FILE* f, const char* path) {
    if (fwrite(src, size, n, f) != n) fail("%s: write failed (%s)", path, write_error_why(errno));
}

static inline void fseek_check(FILE* f, long offset, int whence, const char* path) {
    if (fseek(f, offset, whence) != 0) fail("%s: seek failed (%s)", path, strerror(errno));
}

/* Flushes to disk before closing, so that a rename after it publishes a file
 * whose bytes are really there. */
static inline void fclose_check(FILE* f, const char* path) {
    if (fflush(f) != 0) fail("%s: write failed (%s)", path, write_error_why(errno));
    if (fsync(fileno(f)) != 0 && errno != EINVAL) fail("%s: fsync failed (%s)", path, strerror(errno));
    if (fclose(f) != 0) fail("%s: close failed (%s)", path, strerror(errno));
}

static inline size_t file_size_check(FILE* f, const char* path) {
    struct stat st;
    if (fstat(fileno(f), &st) != 0) fail("%s: cannot stat (%s)", path, strerror(errno));
    return (size_t)st.st_size;
}

/* Files with a header of 256 int32 slots (1024 bytes) before their payload:
 * model, state and evaluation-dump files. header_file_open opens one and
 * reads its header into h; header_file_end checks that its size is the
 * header's `expected` and hands the stream back at the payload. Both close
 * the file and return NULL, with the reason in why[n], when it is not a
 * whole file of its kind: the callers' try-opens fall back past it. */
static inline FILE* header_file_open(const char* path, int32_t h[256], const char* kind, char* why, size_t n) {
    FILE* f = fopen(path, "rb");
    if (!f) {
        snprintf(why, n, "%s: cannot open (%s)", path, strerror(errno));
        return NULL;
    }
    if (fread(h, sizeof(int32_t), 256, f) == 256) return f;
    snprintf(why, n, "%s: too short for a %s header (1024 bytes)", path, kind);
    fclose(f);
    return NULL;
}

/* `size_why` says what the header's size is made of, for the message. */
static inline FILE* header_file_end(FILE* f, const char* path, size_t expected, const char* size_why, char* why, size_t n) {
    size_t actual = file_size_check(f, path);
    if (actual != expected) {
        snprintf(why, n, "%s: size %zu bytes does not match its header (expected %zu%s)", path, actual, expected, size_why);
        fclose(f);
        return NULL;
    }
    if (remat_fopen_hook) remat_fopen_hook(f);
    return f;
}

static inline int file_exists(const char* path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* Atomic file writes: write to "<path>.tmp", then rename over <path>. A crash
 * leaves at worst a stray .tmp file, never a half-written file under the
 * final name. */
typedef struct {
    FILE* f;
    char path[4096];
    char tmp_path[4200];
} AtomicFile;

static inline void atomic_open(AtomicFile* af, const char* path) {
    size_t len = strlen(path);
    if (len >= sizeof(af->path)) fail("%s: path too long", path);
    memcpy(af->path, path, len + 1);
    memcpy(af->tmp_path, path, len);
    memcpy(af->tmp_path + len, ".tmp", 5);
    af->f = fopen_check(af->tmp_path, "wb");
    memcpy(remat_pending_tmp, af->tmp_path, len + 5);
}

/* Flushes a directory's entries (a rename, a removal) to disk. */
static inline void fsync_dir_of(const char* path) {
    char dir[4096];
    const char* slash = strrchr(path, '/');
    size_t len = slash ? (size_t)(slash - path) : 0;
    if (len >= sizeof(dir)) fail("%s: path too long", path);
    if (slash && len == 0) len = 1; /* a file in / */
    if (slash) memcpy(dir, path, len);
    else dir[len++] = '.';
    dir[len] = '\0';
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) fail("%s: cannot open directory (%s)", dir, strerror(errno));
    if (fsync(fd) != 0 && errno != EINVAL) fail("%s: fsync of directory failed (%s)", dir, strerror(errno));
    close(fd);
}

static inline void atomic_commit(AtomicFile* af) {
    fclose_check(af->f, af->tmp_path);
    af->f = NULL;
    if (rename(af->tmp_path, af->path) != 0)
        fail("%s: cannot rename into place (%s)", af->path, strerror(errno));
    remat_pending_tmp[0] = '\0';
    fsync_dir_of(af->path);
}

/* Abandons an atomic write: the temporary file is removed, nothing renamed. */
static inline void atomic_abort(AtomicFile* af) {
    if (af->f) fclose(af->f);
    af->f = NULL;
    remove(af->tmp_path);
    remat_pending_tmp[0] = '\0';
}

/* Creates dir and any missing parents (as mkdir -p); fails unless dir ends up a directory. */
static inline void mkdir_check(const char* dir) {
    char path[4096];
    size_t len = strlen(dir);
    if (len >= sizeof(path)) fail("%s: path too long", dir);
    memcpy(path, dir, len + 1);
    for (size_t i = 1; i < len; i++) {
        if (path[i] != '/') continue;
        path[i] = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST) fail("%s: cannot create directory (%s)", path, strerror(errno));
        path[i] = '/';
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) fail("%s: cannot create directory (%s)", dir, strerror(errno));
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) fail("%s: not a directory", dir);
}

static inline double mib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

/* A size for people: MiB from 1 MiB up, KiB below, bytes below 1 KiB. */
static inline const char* format_size(size_t bytes, char* buf, size_t n) {
    if (bytes >= ((size_t)1 << 20)) snprintf(buf, n, "%.1f MiB", mib(bytes));
    else if (bytes >= 1024) snprintf(buf, n, "%.1f KiB", (double)bytes / 1024.0);
    else snprintf(buf, n, "%zu bytes", bytes);
    return buf;
}

/* A size that exceeds a limit, and the limit: in bytes where format_size
 * would print them alike ("9.0 MiB, more than 9.0 MiB" says nothing). */
static inline void format_size_over(size_t need, size_t have, char* need_buf, char* have_buf, size_t n) {
    format_size(need, need_buf, n);
    format_size(have, have_buf, n);
    if (strcmp(need_buf, have_buf) == 0) { snprintf(need_buf, n, "%zu bytes", need); snprintf(have_buf, n, "%zu bytes", have); }
}

static inline size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* Saturating size arithmetic: SIZE_MAX stands for "does not fit in 64 bits",
 * so a sum or product of sizes can never wrap round to a small number. */
static inline size_t size_mul_sat(size_t a, size_t b) {
    size_t r;
    return __builtin_mul_overflow(a, b, &r) ? SIZE_MAX : r;
}
static inline size_t size_add_sat(size_t a, size_t b) {
    size_t r;
    return __builtin_add_overflow(a, b, &r) ? SIZE_MAX : r;
}

/* A monotonic clock in milliseconds, for timing steps and copies. */
static inline double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* bf16 <-> fp32 bit conversions (model files, bf16 payloads, the GPU's bf16
 * storage): round to nearest even, NaN kept quiet. */
static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#endif
