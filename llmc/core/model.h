/*
 * GPT-2 model shape, parameter layout, initialisation and model files.
 *
 * The 16 parameter tensors live back to back in one buffer in the order of
 * docs/FORMATS.md, so a model file's payload maps onto the buffer 1:1. Both
 * trainers use these functions; they move parameters through small fp32
 * chunks so the same code serves fp32, fp64 (the gradient-check build) and
 * device memory.
 */
#ifndef REMAT_MODEL_H
#define REMAT_MODEL_H

#include <math.h>
#include "utils.h"
#include "rand.h"

#define MODEL_MAGIC 20240326
#define NUM_PARAM_TENSORS 16

typedef struct {
    int max_seq_len;       /* maxT: rows of the position table */
    int vocab_size;        /* V: real vocabulary */
    int padded_vocab_size; /* Vp: V rounded up to a multiple of 128 */
    int num_layers;        /* L */
    int num_heads;         /* NH */
    int channels;          /* C */
} ModelConfig;

enum {
    P_WTE, P_WPE, P_LN1W, P_LN1B, P_QKVW, P_QKVB, P_ATTPROJW, P_ATTPROJB,
    P_LN2W, P_LN2B, P_FCW, P_FCB, P_FCPROJW, P_FCPROJB, P_LNFW, P_LNFB
};

/* The 12 tensors of a transformer block are P_LN1W .. P_FCPROJB, stacked on L. */
#define FIRST_BLOCK_TENSOR P_LN1W
#define NUM_BLOCK_TENSORS 12

/* The parameter tensors (or their gradients) by name: pointers of element
 * type T into one buffer, in the order above. A macro because each trainer
 * stores its own type (real on the CPU, floatX on the GPU). Shapes: */
#define PARAM_TENSORS(T)                                                                  \
    union {                                                                               \
        T* tensor[NUM_PARAM_TENSORS]; /* by index P_WTE .. P_LNFB */                      \
        struct {                                                                          \
            T* wte;      /* (Vp, C) token embeddings; the classifier's weights too */     \
            T* wpe;      /* (maxT, C) position embeddings */                              \
            T* ln1w;     /* (L, C) */                                                     \
            T* ln1b;     /* (L, C) */                                                     \
            T* qkvw;     /* (L, 3C, C) */                                                 \
            T* qkvb;     /* (L, 3C) */                                                    \
            T* attprojw; /* (L, C, C) */                                                  \
            T* attprojb; /* (L, C) */                                                     \
            T* ln2w;     /* (L, C) */                                                     \
            T* ln2b;     /* (L, C) */                                                     \
            T* fcw;      /* (L, 4C, C) */                                                 \
            T* fcb;      /* (L, 4C) */                                                    \
            T* fcprojw;  /* (L, C, 4C) */                                                 \
            T* fcprojb;  /* (L, C) */                                                     \
            T* lnfw;     /* (C) final LayerNorm */                                        \
            T* lnfb;     /* (C) */                                                        \
        };                                                                                \
    }

/* One layer's slice of the block tensors, by name (shapes as above without L). */
#define BLOCK_TENSORS(T)                                                                  \
    union {                                                                               \
        T* tensor[NUM_BLOCK_TENSORS]; /* by index, from FIRST_BLOCK_TENSOR */             \
        struct {                                                                          \
            T* ln1w; T* ln1b; T* qkvw; T* qkvb; T* attprojw; T* attprojb;                 \
            T* ln2w; T* ln2b; T* fcw; T* fcb; T* fcprojw; T* fcprojb;                     \
        };                                                                                \
    }

static const char* const param_tensor_names[NUM_PARAM_TENSORS] = {
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"};

typedef struct {
    size_t count[NUM_PARAM_TENSORS];  /* elements per tensor (all layers) */
    size_t offset[NUM_PARAM_TENSORS]; /* element offset in the parameter buffer */
    size_t total;                     /* elements in all */
} ParamLayout;

static inline int pad_vocab(int vocab_size) { return (vocab_size + 127) / 128 * 128; }

static inline void param_layout(const ModelConfig* cfg, ParamLayout* pl) {
    size_t Vp = (size_t)cfg->padded_vocab_size, C = (size_t)cfg->channels;
    size_t L = (size_t)cfg->num_layers, maxT = (size_t)cfg->max_seq_len;
    size_t counts[NUM_PARAM_TENSORS] = {
        Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
        L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C};
    size_t off = 0;
    for (int i = 0; i < NUM_PARAM_TENSORS; i++) {
        pl->count[i] = counts[i];
        pl->offset[i] = off;
        off += counts[i];
    }
    pl->total = off;
}

/* The parameters whose gradients become final together in backward: with
 * layer in [0, L), that layer's slice of each of the 12 stacked block
 * tensors; with layer -1, the tensors outside the blocks (wte, wpe, lnfw,
 * lnfb). Writes element offsets and counts; returns how many slices. */
static inline int param_group_slices(const ParamLayout* pl, int num_layers, int layer, size_t* off, size_t* cnt) {
    int n = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        int stacked = t != P_WTE && t != P_WPE && t != P_LNFW && t != P_LNFB;
        if (stacked != (layer >= 0)) continue;
        size_t per_layer = stacked ? pl->count[t] / (size_t)num_layers : pl->count[t];
        off[n] = pl->offset[t] + (stacked ? (size_t)layer * per_layer : 0);
        cnt[n++] = per_layer;
    }
    return n;
}

/* Weight decay applies to the 2-D weight matrices only, never to biases or
 * LayerNorm parameters. */
static inline int param_is_decayed(int tensor) {
    return tensor == P_WTE || tensor == P_WPE || tensor == P_QKVW || tensor == P_ATTPROJW ||
           tensor == P_FCW || tensor == P_FCPROJW;
}

/* Returns 0 and fills cfg for a known descriptor (d6 d12 d24 d36 d48), else -1. */
static inline int config_from_descriptor(const char* desc, ModelConfig* cfg) {
    static const struct { const char* name; int L, NH, C; } known[] = {
        {"d6", 6, 6, 384}, {"d12", 12, 12, 768}, {"d24", 24, 16, 1024},
        {"d36", 36, 20, 1280}, {"d48", 48, 25, 1600}};
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
        if (strcmp(desc, known[i].name) == 0) {
            cfg->num_layers = known[i].L;
            cfg->num_heads = known[i].NH;
            cfg->channels = known[i].C;
            cfg->max_seq_len = 1024;
            cfg->vocab_size = 50257;
            cfg->padded_vocab_size = pad_vocab(50257);
            return 0;
        }
    }
    return -1;
}

/* What is wrong with a shape, into why[n] (`what` names its source); 0 when nothing. */
static inline int config_problem(const ModelConfig* c, const char* what, char* why, size_t n) {
    if (c->num_layers < 1 || c->num_layers > 4096) snprintf(why, n, "%s: number of layers %d out of range [1, 4096]", what, c->num_layers);
    else if (c->num_heads < 1) snprintf(why, n, "%s: number of heads %d must be positive", what, c->num_heads);
    else if (c->channels < 1 || c->channels > (1 << 16)) snprintf(why, n, "%s: channels %d out of range [1, 65536]", what, c->channels);
    else if (c->channels % c->num_heads != 0) snprintf(why, n, "%s: channels %d not divisible by heads %d", what, c->channels, c->num_heads);
    else if (c->vocab_size < 2 || c->vocab_size > 65536)
        snprintf(why, n, "%s: vocabulary size %d out of range [2, 65536] (tokens are uint16)", what, c->vocab_size);
    else if (c->padded_vocab_size < c->vocab_size || c->padded_vocab_size > (1 << 17))
        snprintf(why, n, "%s: padded vocabulary %d out of range [%d, 131072] (the vocabulary %d and up)", what, c->padded_vocab_size,
                 c->vocab_size, c->vocab_size);
    /* 2^22: long enough for a context-parallel group's sequence (docs/context-parallel.md) */
    else if (c->max_seq_len < 1 || c->max_seq_len > (1 << 22))
        snprintf(why, n, "%s: max sequence length %d out of range [1, 4194304]", what, c->max_seq_len);
    else return 0;
    return -1;
}

/* Checks a shape for internal consistency; `what` names its source. */
static inline void config_validate(const ModelConfig* c, const char* what) {
    char why[600];
    if (config_problem(c, what, why, sizeof(why))) fail("%s", why);
}

/* Standard deviation of a tensor's init; 0 means a constant fill. */
static inline float param_init_std(const ModelConfig* cfg, int tensor) {
    switch (tensor) {
    case P_WTE: case P_WPE: case P_QKVW: case P_FCW: return 0.02f;
    case P_ATTPROJW: case P_FCPROJW: return 0.02f / sqrtf(2.0f * (float)cfg->num_layers);
    default: return 0.0f;
    }
}

/* Fills out[0..n) with elements [start, start+n) of tensor `tensor` at init:
 * N(0, std) weights, LayerNorm weights 1, biases 0, padded wte rows 0. */
static inline void param_init_chunk(const ModelConfig* cfg, uint64_t seed, int tensor,
                                    size_t start, size_t n, float* out) {
    float std = param_init_std(cfg, tensor);
    float fill = (tensor == P_LN1W || tensor == P_LN2W || tensor == P_LNFW) ? 1.0f : 0.0f;
    size_t real_wte = (size_t)cfg->vocab_size * (size_t)cfg->channels;
    /* each value is a pure function of (seed, tensor, element): safe to split across threads */
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        size_t e = start + i;
        if (std == 0.0f || (tensor == P_WTE && e >= real_wte)) out[i] = fill;
        else out[i] = std * rand_normal(seed, (uint64_t)tensor, e);
    }
}

/* ---- model files (docs/FORMATS.md) ---- */

/* Header slots 242-244 (llm.c readers ignore them, its files have zeros
 * there): the dropout probabilities, as fp32 bits, that an imported config
 * gave (Hugging Face's embd_pdrop, attn_pdrop, resid_pdrop) or a remat run
 * trained with; 0: none. */
#define MODEL_DROPOUT_SLOT 242
enum { MODEL_PDROP_EMBD, MODEL_PDROP_ATTN, MODEL_PDROP_RESID, MODEL_NUM_PDROP };
static const char* const model_pdrop_names[MODEL_NUM_PDROP] = {"embd_pdrop", "attn_pdrop", "resid_pdrop"};
/* The range of a dropout probability, in a model file and in the flags
 * (core/cli.h); p = 1 has no inverse scale (core/dropout.h). */
#define DROPOUT_MAX_P 0.99

typedef struct {
    ModelConfig cfg;
    int version;       /* 3: fp32 payload, 5: bf16 payload */
    size_t num_params; /* elements in the payload */
    float pdrop[MODEL_NUM_PDROP];
} ModelFileInfo;

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

/* Opens a model file and validates its header and exact size; the stream
 * is positioned at the payload. NULL, with the reason in why[n], when the
 * file cannot be opened or is not a whole model file. */
static inline FILE* model_file_try_open(const char* path, ModelFileInfo* info, char* why, size_t n) {
    int32_t h[256];
    size_t elem = 0; /* declared before the gotos: C++ (nvcc) refuses a jump past an initialisation */
    char size_why[96];
    FILE* f = header_file_open(path, h, "model file", why, n);
    if (!f) return NULL;
    if (h[0] != MODEL_MAGIC) { snprintf(why, n, "%s: bad magic %d (expected %d: not an llm.c model file)", path, h[0], MODEL_MAGIC); goto bad; }
    if (h[1] != 3 && h[1] != 5) { snprintf(why, n, "%s: unsupported model file version %d (expected 3 or 5)", path, h[1]); goto bad; }
    info->version = h[1];
    info->cfg.max_seq_len = h[2];
    info->cfg.vocab_size = h[3];
    info->cfg.num_layers = h[4];
    info->cfg.num_heads = h[5];
    info->cfg.channels = h[6];
    info->cfg.padded_vocab_size = h[7];
    if (config_problem(&info->cfg, path, why, n)) goto bad;
    for (int k = 0; k < MODEL_NUM_PDROP; k++) {
        memcpy(&info->pdrop[k], &h[MODEL_DROPOUT_SLOT + k], 4);
        if (!(info->pdrop[k] >= 0.0f && info->pdrop[k] <= (float)DROPOUT_MAX_P)) {
            snprintf(why, n, "%s: header slot %d (%s) is %g: not a dropout probability in [0, %g]", path, MODEL_DROPOUT_SLOT + k,
                     model_pdrop_names[k], (double)info->pdrop[k], DROPOUT_MAX_P);
            goto bad;
        }
    }
    ParamLayout pl;
    param_layout(&info->cfg, &pl);
    info->num_params = pl.total;
    elem = info->version == 3 ? 4 : 2;
    snprintf(size_why, sizeof(size_why), ": %zu parameters x %zu bytes + 1024", pl.total, elem);
    return header_file_end(f, path, 1024 + pl.total * elem, size_why, why, n);
bad:
    fclose(f);
    return NULL;
}

static inline FILE* model_file_open(const char* path, ModelFileInfo* info) {
    char why[4800];
    FILE* f = model_file_try_open(path, info, why, sizeof(why));
    if (!f) fail("%s", why);
    return f;
}

/* Reads the next n parameters of an open model file as fp32. */
static inline void model_file_read_chunk(FILE* f, const ModelFileInfo* info, float* out, size_t n, const char* path) {
    if (info->version == 3) {
        fread_check(out, sizeof(float), n, f, path);
        return;
    }
    uint16_t* half = (uint16_t*)out + n; /* upper half of out as staging: n bf16 fit in n/2 floats */
    fread_check(half, sizeof(uint16_t), n, f, path);
    for (size_t i = 0; i < n; i++) out[i] = bf16_to_float(half[i]);
}

/* Reads payload elements [first, first+n) as fp32 (random access: fseeko,
 * as files past 2 GiB are common). */
static inline void model_file_read_at(FILE* f, const ModelFileInfo* info, size_t first, float* out, size_t n, const char* path) {
    size_t elem = info->version == 3 ? 4 : 2;
    if (fseeko(f, (off_t)(1024 + first * elem), SEEK_SET) != 0) fail("%s: seek failed (%s)", path, strerror(errno));
    model_file_read_chunk(f, info, out, n, path);
}

static inline void model_file_write_header(FILE* f, const ModelConfig* cfg, int version, const float* pdrop, const char* path) {
    int32_t h[256];
    memset(h, 0, sizeof(h));
    h[0] = MODEL_MAGIC;
    h[1] = version;
    h[2] = cfg->max_seq_len;
    h[3] = cfg->vocab_size;
    h[4] = cfg->num_layers;
    h[5] = cfg->num_heads;
    h[6] = cfg->channels;
    h[7] = cfg->padded_vocab_size;
    memcpy(&h[MODEL_DROPOUT_SLOT], pdrop, MODEL_NUM_PDROP * sizeof(float));
    fwrite_check(h, sizeof(int32_t), 256, f, path);
}

/* Writes n fp32 parameters as version `version` payload. For bf16 the input
 * chunk is converted in place into its own first half. */
static inline void model_file_write_chunk(FILE* f, int version, float* chunk, size_t n, const char* path) {
    if (version == 3) {
        fwrite_check(chunk, sizeof(float), n, f, path);
        return;
    }
    uint16_t* half = (uint16_t*)chunk;
    for (size_t i = 0; i < n; i++) half[i] = float_to_bf16(chunk[i]);
    fwrite_check(half, sizeof(uint16_t), n, f, path);
}

#endif
