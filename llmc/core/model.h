/*
 * Model shape and architecture switches (GPT-2, and the configurable family:
 * Llama, Qwen2), parameter layout, initialisation, presets and model files.
 *
 * The 17 parameter tensors (those the switches leave out have no elements)
 * live back to back in one buffer in the order of docs/FORMATS.md, so a
 * model file's payload maps onto the buffer 1:1. Both
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
#define NUM_PARAM_TENSORS 17

/* The architecture switches (docs/FORMATS.md, model file versions 7/8). A
 * configuration whose family is 0 has none of them set: it is GPT-2 of its
 * (L, NH, C), and config_resolved fills them in, so that code and tests
 * that build a GPT-2 shape from its six numbers stay as they are. */
enum { FAMILY_UNSET = 0, FAMILY_GPT2 = 1, FAMILY_LLAMA = 2, FAMILY_QWEN2 = 3 };
enum { NORM_LAYERNORM = 0, NORM_RMSNORM = 1 };
enum { POS_LEARNED = 0, POS_ROPE = 1 };
enum { ROPE_DEFAULT = 0, ROPE_LINEAR = 1, ROPE_LLAMA3 = 2, ROPE_YARN = 3 };
enum { MLP_GELU = 0, MLP_SWIGLU = 1 };
/* bias mask bits: which tensors of the block carry a bias */
enum { BIAS_QKV = 1, BIAS_ATTPROJ = 2, BIAS_MLP = 4, BIAS_NORM = 8, BIAS_ALL = 15 };
static const char* const family_names[4] = {"gpt2", "gpt2", "llama", "qwen2"};
static const char* const rope_type_names[4] = {"default", "linear", "llama3", "yarn"};

typedef struct {
    int max_seq_len;       /* maxT: rows of the position table; with RoPE the longest sequence set up for */
    int vocab_size;        /* V: real vocabulary */
    int padded_vocab_size; /* Vp: V rounded up to a multiple of 128 */
    int num_layers;        /* L */
    int num_heads;         /* NH: query heads */
    int channels;          /* C */
    /* the switches; all 0 (family FAMILY_UNSET) for GPT-2 */
    int family;            /* FAMILY_*: a name for export; the switches decide the computation */
    int num_kv_heads;      /* NKV: K/V heads, NH a multiple of it */
    int head_size;         /* HD: NH x HD may differ from C */
    int ffn;               /* F: MLP width (GELU 4C for GPT-2; SwiGLU's intermediate_size) */
    int norm;              /* NORM_* */
    float norm_eps;
    int positions;         /* POS_* */
    float rope_theta;
    int rope_scaling;      /* ROPE_* */
    float rope_factor;
    float rope_low;        /* llama3: low_freq_factor; yarn: beta_fast */
    float rope_high;       /* llama3: high_freq_factor; yarn: beta_slow */
    int rope_original_max; /* original_max_position_embeddings (llama3, yarn) */
    float rope_attn_factor;/* yarn's attention factor; 0: 0.1 ln(factor) + 1 */
    int mlp;               /* MLP_* */
    int bias;              /* BIAS_* mask */
    int tied;              /* 1: the classifier is wte; 0: its own (Vp, C) lm_head */
    int bos, eos;          /* token ids, -1 none */
    int hf_max_positions;  /* config.json's max_position_embeddings (0 unknown), for export */
} ModelConfig;

/* The configuration with GPT-2's switches filled in when none is set. */
static inline ModelConfig config_resolved(const ModelConfig* c) {
    ModelConfig r = *c;
    if (r.family != FAMILY_UNSET) return r;
    r.family = FAMILY_GPT2;
    r.num_kv_heads = r.num_heads;
    r.head_size = r.num_heads > 0 ? r.channels / r.num_heads : 0;
    r.ffn = 4 * r.channels;
    r.norm = NORM_LAYERNORM;
    r.norm_eps = 1e-5f;
    r.positions = POS_LEARNED;
    r.rope_scaling = ROPE_DEFAULT;
    r.rope_factor = 1.0f;
    r.mlp = MLP_GELU;
    r.bias = BIAS_ALL;
    r.tied = 1;
    r.bos = r.eos = -1;
    return r;
}

/* Whether the configuration computes GPT-2 (every switch GPT-2's); such a
 * model is written as a version 3/5 file, and the GPU trainer runs only it. */
static inline int config_is_gpt2(const ModelConfig* c) {
    ModelConfig r = config_resolved(c);
    return r.family == FAMILY_GPT2 && r.num_kv_heads == r.num_heads && r.head_size * r.num_heads == r.channels &&
           r.ffn == 4 * r.channels && r.norm == NORM_LAYERNORM && r.norm_eps == 1e-5f && r.positions == POS_LEARNED &&
           r.mlp == MLP_GELU && r.bias == BIAS_ALL && r.tied == 1;
}

/* Every width the block has, from the configuration: the one place they are
 * computed (param_layout, the memory plan and both trainers read them). */
typedef struct {
    int NH, NKV, HD; /* query heads, K/V heads, head size */
    int q_width;     /* NH x HD: queries, and attention's output */
    int kv_width;    /* NKV x HD: keys (and values) */
    int qkv_width;   /* (NH + 2 NKV) HD: the QKV matmul's output, rows [Q heads | K heads | V heads] */
    int F;           /* MLP width: GELU's hidden, SwiGLU's intermediate (its product's width) */
    int fc_width;    /* the FC matmul's output: F (GELU) or 2F (SwiGLU: [gate | up]) */
} BlockWidths;

static inline BlockWidths block_widths(const ModelConfig* c) {
    ModelConfig r = config_resolved(c);
    BlockWidths w;
    w.NH = r.num_heads;
    w.NKV = r.num_kv_heads;
    w.HD = r.head_size;
    w.q_width = w.NH * w.HD;
    w.kv_width = w.NKV * w.HD;
    w.qkv_width = w.q_width + 2 * w.kv_width;
    w.F = r.ffn;
    w.fc_width = r.mlp == MLP_SWIGLU ? 2 * r.ffn : r.ffn;
    return w;
}

enum {
    P_WTE, P_WPE, P_LN1W, P_LN1B, P_QKVW, P_QKVB, P_ATTPROJW, P_ATTPROJB,
    P_LN2W, P_LN2B, P_FCW, P_FCB, P_FCPROJW, P_FCPROJB, P_LNFW, P_LNFB, P_LMHEAD
};

/* The 12 tensors of a transformer block are P_LN1W .. P_FCPROJB, stacked on L. */
#define FIRST_BLOCK_TENSOR P_LN1W
#define NUM_BLOCK_TENSORS 12

/* The parameter tensors (or their gradients) by name: pointers of element
 * type T into one buffer, in the order above. A macro because each trainer
 * stores its own type (real on the CPU, floatX on the GPU). Shapes: */
#define PARAM_TENSORS(T)                                                                  \
    union {                                                                               \
        T* tensor[NUM_PARAM_TENSORS]; /* by index P_WTE .. P_LMHEAD */                    \
        struct {                                                                          \
            T* wte;      /* (Vp, C) token embeddings; the classifier's weights when tied */\
            T* wpe;      /* (maxT, C) position embeddings (learned positions) */          \
            T* ln1w;     /* (L, C) */                                                     \
            T* ln1b;     /* (L, C) */                                                     \
            T* qkvw;     /* (L, (NH + 2 NKV) HD, C); GPT-2: (L, 3C, C) */                 \
            T* qkvb;     /* (L, (NH + 2 NKV) HD) */                                       \
            T* attprojw; /* (L, C, NH HD) */                                              \
            T* attprojb; /* (L, C) */                                                     \
            T* ln2w;     /* (L, C) */                                                     \
            T* ln2b;     /* (L, C) */                                                     \
            T* fcw;      /* (L, F, C), SwiGLU (L, 2F, C) [gate; up]; GPT-2 F = 4C */       \
            T* fcb;      /* (L, F), SwiGLU (L, 2F) */                                     \
            T* fcprojw;  /* (L, C, F) */                                                  \
            T* fcprojb;  /* (L, C) */                                                     \
            T* lnfw;     /* (C) final norm */                                             \
            T* lnfb;     /* (C) */                                                        \
            T* lm_head;  /* (Vp, C) the untied classifier */                              \
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
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb", "lm_head"};

typedef struct {
    size_t count[NUM_PARAM_TENSORS];  /* elements per tensor (all layers) */
    size_t offset[NUM_PARAM_TENSORS]; /* element offset in the parameter buffer */
    size_t total;                     /* elements in all */
} ParamLayout;

static inline int pad_vocab(int vocab_size) { return (vocab_size + 127) / 128 * 128; }

/* Every tensor's element count from the configuration (docs/FORMATS.md):
 * a tensor the switches leave out (wpe with RoPE, a bias the mask drops,
 * lm_head when tied) has count 0 and takes no room. */
static inline void param_layout(const ModelConfig* cfg, ParamLayout* pl) {
    ModelConfig r = config_resolved(cfg);
    BlockWidths w = block_widths(&r);
    size_t Vp = (size_t)r.padded_vocab_size, C = (size_t)r.channels;
    size_t L = (size_t)r.num_layers, maxT = (size_t)r.max_seq_len;
    size_t QKV = (size_t)w.qkv_width, Q = (size_t)w.q_width, F = (size_t)w.F, FC = (size_t)w.fc_width;
    size_t norm_b = r.bias & BIAS_NORM ? 1 : 0, qkv_b = r.bias & BIAS_QKV ? 1 : 0;
    size_t proj_b = r.bias & BIAS_ATTPROJ ? 1 : 0, mlp_b = r.bias & BIAS_MLP ? 1 : 0;
    size_t counts[NUM_PARAM_TENSORS] = {
        Vp * C, r.positions == POS_LEARNED ? maxT * C : 0, L * C, norm_b * L * C, L * QKV * C, qkv_b * L * QKV,
        L * C * Q, proj_b * L * C, L * C, norm_b * L * C, L * FC * C, mlp_b * L * FC, L * C * F, mlp_b * L * C,
        C, norm_b * C, r.tied ? 0 : Vp * C};
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
 * lnfb, lm_head). Writes element offsets and counts (0 for an absent
 * tensor); returns how many slices. */
static inline int param_group_slices(const ParamLayout* pl, int num_layers, int layer, size_t* off, size_t* cnt) {
    int n = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        int stacked = t != P_WTE && t != P_WPE && t != P_LNFW && t != P_LNFB && t != P_LMHEAD;
        if (stacked != (layer >= 0)) continue;
        size_t per_layer = stacked ? pl->count[t] / (size_t)num_layers : pl->count[t];
        off[n] = pl->offset[t] + (stacked ? (size_t)layer * per_layer : 0);
        cnt[n++] = per_layer;
    }
    return n;
}

/* Weight decay applies to the 2-D weight matrices only, never to biases or
 * norm weights. */
static inline int param_is_decayed(int tensor) {
    return tensor == P_WTE || tensor == P_WPE || tensor == P_QKVW || tensor == P_ATTPROJW ||
           tensor == P_FCW || tensor == P_FCPROJW || tensor == P_LMHEAD;
}

/* The presets: the shapes of Hugging Face config.json files, for plans and
 * random-init runs without the weights (docs/FORMATS.md's support table). */
typedef struct {
    const char* name;
    int family, L, NH, NKV, HD, C, F, V, max_pos, tied, bias, bos, eos;
    float eps, theta;
    int scaling;
    float factor, low, high;
    int original_max;
} ModelPreset;

static const ModelPreset model_presets[] = {
    /* HuggingFaceTB/SmolLM2-135M */
    {"smollm2-135m", FAMILY_LLAMA, 30, 9, 3, 64, 576, 1536, 49152, 8192, 1, 0, 1, 2, 1e-5f, 100000.0f, ROPE_DEFAULT, 1.0f, 0, 0, 0},
    /* Qwen/Qwen2.5-0.5B, -1.5B, -7B: q/k/v biases, RMSNorm eps 1e-6 */
    {"qwen2.5-0.5b", FAMILY_QWEN2, 24, 14, 2, 64, 896, 4864, 151936, 32768, 1, BIAS_QKV, 151643, 151643, 1e-6f, 1000000.0f, ROPE_DEFAULT, 1.0f, 0, 0, 0},
    {"qwen2.5-1.5b", FAMILY_QWEN2, 28, 12, 2, 128, 1536, 8960, 151936, 131072, 1, BIAS_QKV, 151643, 151643, 1e-6f, 1000000.0f, ROPE_DEFAULT, 1.0f, 0, 0, 0},
    {"qwen2.5-7b", FAMILY_QWEN2, 28, 28, 4, 128, 3584, 18944, 152064, 131072, 0, BIAS_QKV, 151643, 151643, 1e-6f, 1000000.0f, ROPE_DEFAULT, 1.0f, 0, 0, 0},
    /* meta-llama/Llama-3.2-1B, -3B, Llama-3.1-8B: llama3 rope scaling */
    {"llama3.2-1b", FAMILY_LLAMA, 16, 32, 8, 64, 2048, 8192, 128256, 131072, 1, 0, 128000, 128001, 1e-5f, 500000.0f, ROPE_LLAMA3, 32.0f, 1.0f, 4.0f, 8192},
    {"llama3.2-3b", FAMILY_LLAMA, 28, 24, 8, 128, 3072, 8192, 128256, 131072, 1, 0, 128000, 128001, 1e-5f, 500000.0f, ROPE_LLAMA3, 32.0f, 1.0f, 4.0f, 8192},
    {"llama3.1-8b", FAMILY_LLAMA, 32, 32, 8, 128, 4096, 14336, 128256, 131072, 0, 0, 128000, 128001, 1e-5f, 500000.0f, ROPE_LLAMA3, 8.0f, 1.0f, 4.0f, 8192},
};
#define NUM_MODEL_PRESETS ((int)(sizeof(model_presets) / sizeof(model_presets[0])))
#define MODEL_DESCRIPTOR_LIST "d6, d12, d24, d36, d48, smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, llama3.2-1b, llama3.2-3b, llama3.1-8b"

static inline void config_from_preset(const ModelPreset* p, ModelConfig* cfg) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->max_seq_len = p->max_pos;
    cfg->vocab_size = p->V;
    cfg->padded_vocab_size = pad_vocab(p->V);
    cfg->num_layers = p->L;
    cfg->num_heads = p->NH;
    cfg->channels = p->C;
    cfg->family = p->family;
    cfg->num_kv_heads = p->NKV;
    cfg->head_size = p->HD;
    cfg->ffn = p->F;
    cfg->norm = NORM_RMSNORM;
    cfg->norm_eps = p->eps;
    cfg->positions = POS_ROPE;
    cfg->rope_theta = p->theta;
    cfg->rope_scaling = p->scaling;
    cfg->rope_factor = p->factor;
    cfg->rope_low = p->low;
    cfg->rope_high = p->high;
    cfg->rope_original_max = p->original_max;
    cfg->mlp = MLP_SWIGLU;
    cfg->bias = p->bias;
    cfg->tied = p->tied;
    cfg->bos = p->bos;
    cfg->eos = p->eos;
    cfg->hf_max_positions = p->max_pos;
}

/* Returns 0 and fills cfg for a known descriptor (GPT-2's d6 d12 d24 d36
 * d48, or a preset), else -1. */
static inline int config_from_descriptor(const char* desc, ModelConfig* cfg) {
    static const struct { const char* name; int L, NH, C; } known[] = {
        {"d6", 6, 6, 384}, {"d12", 12, 12, 768}, {"d24", 24, 16, 1024},
        {"d36", 36, 20, 1280}, {"d48", 48, 25, 1600}};
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
        if (strcmp(desc, known[i].name) == 0) {
            memset(cfg, 0, sizeof(*cfg));
            cfg->num_layers = known[i].L;
            cfg->num_heads = known[i].NH;
            cfg->channels = known[i].C;
            cfg->max_seq_len = 1024;
            cfg->vocab_size = 50257;
            cfg->padded_vocab_size = pad_vocab(50257);
            return 0;
        }
    }
    for (int i = 0; i < NUM_MODEL_PRESETS; i++)
        if (strcmp(desc, model_presets[i].name) == 0) {
            config_from_preset(&model_presets[i], cfg);
            return 0;
        }
    return -1;
}

/* The vocabulary's upper bound, padded too, for every family: Qwen2.5's
 * 151,936 and Gemma's 256,000 fit; beyond 65,536 the token shards are
 * version 7 (uint32, core/dataloader.h). */
#define MODEL_MAX_VOCAB (1 << 18)

/* Header slots 8-27 of versions 7/8 (docs/FORMATS.md): the switches. */
enum {
    SLOT_FAMILY = 8, SLOT_NKV, SLOT_HD, SLOT_FFN, SLOT_NORM, SLOT_NORM_EPS, SLOT_POSITIONS, SLOT_ROPE_THETA, SLOT_ROPE_SCALING,
    SLOT_ROPE_FACTOR, SLOT_ROPE_LOW, SLOT_ROPE_HIGH, SLOT_ROPE_ORIGINAL_MAX, SLOT_ROPE_ATTN_FACTOR, SLOT_MLP, SLOT_BIAS, SLOT_TIED,
    SLOT_BOS, SLOT_EOS, SLOT_HF_MAX_POS, SLOT_FIRST_UNUSED
};
static const char* const model_slot_names[SLOT_FIRST_UNUSED - SLOT_FAMILY] = {
    "family", "K/V heads", "head size", "MLP width", "norm", "norm epsilon", "positions", "RoPE theta", "RoPE scaling",
    "RoPE factor", "low_freq_factor/beta_fast", "high_freq_factor/beta_slow", "original_max_position_embeddings",
    "yarn attention factor", "MLP kind", "bias mask", "tied head", "bos token", "eos token", "max_position_embeddings"};

/* What is wrong with the switches of a configurable-family shape, into
 * why[n], and *slot_out: the model file's header slot that holds it
 * (docs/FORMATS.md); 0 when nothing. */
/* A switch's problem: its message into why[n], its header slot into *slot_out. */
#define SWITCH_PROBLEM(slot, ...)            \
    do {                                     \
        snprintf(why, n, __VA_ARGS__);       \
        *slot_out = (slot);                  \
        return -1;                           \
    } while (0)

static inline int config_switch_problem(const ModelConfig* c, const char* what, char* why, size_t n, int* slot_out) {
    int rope = c->positions == POS_ROPE, scaled = rope && c->rope_scaling != ROPE_DEFAULT;
    int llama3 = scaled && c->rope_scaling == ROPE_LLAMA3, yarn = scaled && c->rope_scaling == ROPE_YARN;
    if (c->family < FAMILY_GPT2 || c->family > FAMILY_QWEN2)
        SWITCH_PROBLEM(SLOT_FAMILY, "%s: family %d unknown (1 gpt2, 2 llama, 3 qwen2)", what, c->family);
    if (c->num_kv_heads < 1 || c->num_heads % c->num_kv_heads != 0)
        SWITCH_PROBLEM(SLOT_NKV, "%s: K/V heads %d must be positive and divide the %d query heads", what, c->num_kv_heads, c->num_heads);
    if (c->head_size < 1 || c->head_size > 4096) SWITCH_PROBLEM(SLOT_HD, "%s: head size %d out of range [1, 4096]", what, c->head_size);
    if ((long long)(c->num_heads + 2 * c->num_kv_heads) * c->head_size > (1 << 20))
        SWITCH_PROBLEM(SLOT_HD, "%s: QKV width (%d + 2 x %d) x %d too large (at most 1048576)", what, c->num_heads, c->num_kv_heads,
                       c->head_size);
    if (c->ffn < 1 || c->ffn > (1 << 20)) SWITCH_PROBLEM(SLOT_FFN, "%s: MLP width %d out of range [1, 1048576]", what, c->ffn);
    if (c->norm != NORM_LAYERNORM && c->norm != NORM_RMSNORM)
        SWITCH_PROBLEM(SLOT_NORM, "%s: norm %d unknown (0 LayerNorm, 1 RMSNorm)", what, c->norm);
    if (!(c->norm_eps > 0.0f && c->norm_eps < 1.0f)) SWITCH_PROBLEM(SLOT_NORM_EPS, "%s: norm epsilon %g not in (0, 1)", what, (double)c->norm_eps);
    if (c->positions != POS_LEARNED && !rope) SWITCH_PROBLEM(SLOT_POSITIONS, "%s: positions %d unknown (0 learned, 1 RoPE)", what, c->positions);
    if (rope && c->head_size % 2 != 0) SWITCH_PROBLEM(SLOT_HD, "%s: head size %d must be even for RoPE", what, c->head_size);
    if (rope && !(c->rope_theta > 1.0f && isfinite(c->rope_theta)))
        SWITCH_PROBLEM(SLOT_ROPE_THETA, "%s: RoPE theta %g must be a finite number above 1", what, (double)c->rope_theta);
    if (c->rope_scaling < ROPE_DEFAULT || c->rope_scaling > ROPE_YARN)
        SWITCH_PROBLEM(SLOT_ROPE_SCALING, "%s: RoPE scaling %d unknown (0 default, 1 linear, 2 llama3, 3 yarn)", what, c->rope_scaling);
    if (scaled && !(c->rope_factor >= 1.0f && isfinite(c->rope_factor)))
        SWITCH_PROBLEM(SLOT_ROPE_FACTOR, "%s: RoPE scaling factor %g must be finite and at least 1", what, (double)c->rope_factor);
    if (llama3 && !(c->rope_low > 0.0f))
        SWITCH_PROBLEM(SLOT_ROPE_LOW, "%s: llama3 RoPE low_freq_factor %g must be positive", what, (double)c->rope_low);
    if (llama3 && !(c->rope_high > c->rope_low && isfinite(c->rope_high)))
        SWITCH_PROBLEM(SLOT_ROPE_HIGH, "%s: llama3 RoPE high_freq_factor %g must be above low_freq_factor %g", what, (double)c->rope_high,
                       (double)c->rope_low);
    if (yarn && !(c->rope_low > 0.0f)) SWITCH_PROBLEM(SLOT_ROPE_LOW, "%s: yarn beta_fast %g must be positive", what, (double)c->rope_low);
    if (yarn && !(c->rope_high > 0.0f)) SWITCH_PROBLEM(SLOT_ROPE_HIGH, "%s: yarn beta_slow %g must be positive", what, (double)c->rope_high);
    if ((llama3 || yarn) && c->rope_original_max < 1)
        SWITCH_PROBLEM(SLOT_ROPE_ORIGINAL_MAX, "%s: RoPE scaling %s needs original_max_position_embeddings (%d)", what,
                       rope_type_names[c->rope_scaling], c->rope_original_max);
    if (!(c->rope_attn_factor >= 0.0f && c->rope_attn_factor < 100.0f))
        SWITCH_PROBLEM(SLOT_ROPE_ATTN_FACTOR, "%s: yarn attention factor %g out of range [0, 100)", what, (double)c->rope_attn_factor);
    if (c->mlp != MLP_GELU && c->mlp != MLP_SWIGLU) SWITCH_PROBLEM(SLOT_MLP, "%s: MLP %d unknown (0 GELU, 1 SwiGLU)", what, c->mlp);
    if (c->bias < 0 || c->bias > BIAS_ALL) SWITCH_PROBLEM(SLOT_BIAS, "%s: bias mask %d out of range [0, 15]", what, c->bias);
    if (c->tied != 0 && c->tied != 1) SWITCH_PROBLEM(SLOT_TIED, "%s: head %d unknown (1 tied, 0 untied)", what, c->tied);
    if (c->bos < -1 || c->bos >= c->vocab_size) SWITCH_PROBLEM(SLOT_BOS, "%s: bos token %d not in the vocabulary (or -1)", what, c->bos);
    if (c->eos < -1 || c->eos >= c->vocab_size) SWITCH_PROBLEM(SLOT_EOS, "%s: eos token %d not in the vocabulary (or -1)", what, c->eos);
    if (c->hf_max_positions < 0) SWITCH_PROBLEM(SLOT_HF_MAX_POS, "%s: max_position_embeddings %d negative", what, c->hf_max_positions);
    return 0;
}
#undef SWITCH_PROBLEM

/* What is wrong with a shape, into why[n] (`what` names its source), and
 * with a switch at fault the header slot that holds it in *slot (else 0);
 * 0 when nothing. */
static inline int config_problem_slot(const ModelConfig* c, const char* what, char* why, size_t n, int* slot) {
    *slot = 0;
    int gpt2 = c->family == FAMILY_UNSET;
    if (c->num_layers < 1 || c->num_layers > 4096) snprintf(why, n, "%s: number of layers %d out of range [1, 4096]", what, c->num_layers);
    else if (c->num_heads < 1) snprintf(why, n, "%s: number of heads %d must be positive", what, c->num_heads);
    else if (c->channels < 1 || c->channels > (1 << 16)) snprintf(why, n, "%s: channels %d out of range [1, 65536]", what, c->channels);
    else if (gpt2 && c->channels % c->num_heads != 0) snprintf(why, n, "%s: channels %d not divisible by heads %d", what, c->channels, c->num_heads);
    else if (c->vocab_size < 2 || c->vocab_size > MODEL_MAX_VOCAB) /* Qwen2.5's 151,936 and Gemma's 256,000 fit */
        snprintf(why, n, "%s: vocabulary size %d out of range [2, %d]", what, c->vocab_size, MODEL_MAX_VOCAB);
    else if (c->padded_vocab_size < c->vocab_size || c->padded_vocab_size > MODEL_MAX_VOCAB)
        snprintf(why, n, "%s: padded vocabulary %d out of range [%d, %d] (the vocabulary %d and up)", what, c->padded_vocab_size,
                 c->vocab_size, MODEL_MAX_VOCAB, c->vocab_size);
    /* 2^22: long enough for a context-parallel group's sequence (docs/context-parallel.md) */
    else if (c->max_seq_len < 1 || c->max_seq_len > (1 << 22))
        snprintf(why, n, "%s: max sequence length %d out of range [1, 4194304]", what, c->max_seq_len);
    else if (!gpt2) return config_switch_problem(c, what, why, n, slot);
    else return 0;
    return -1;
}

static inline int config_problem(const ModelConfig* c, const char* what, char* why, size_t n) {
    int slot;
    return config_problem_slot(c, what, why, n, &slot);
}

/* Checks a shape for internal consistency; `what` names its source. */
static inline void config_validate(const ModelConfig* c, const char* what) {
    char why[600];
    if (config_problem(c, what, why, sizeof(why))) fail("%s", why);
}

/* Standard deviation of a tensor's init; 0 means a constant fill. */
static inline float param_init_std(const ModelConfig* cfg, int tensor) {
    switch (tensor) {
    case P_WTE: case P_WPE: case P_QKVW: case P_FCW: case P_LMHEAD: return 0.02f;
    case P_ATTPROJW: case P_FCPROJW: return 0.02f / sqrtf(2.0f * (float)cfg->num_layers);
    default: return 0.0f;
    }
}

/* Fills out[0..n) with elements [start, start+n) of tensor `tensor` at init:
 * N(0, std) weights, norm weights 1, biases 0, padded wte and lm_head rows 0. */
static inline void param_init_chunk(const ModelConfig* cfg, uint64_t seed, int tensor,
                                    size_t start, size_t n, float* out) {
    float std = param_init_std(cfg, tensor);
    float fill = (tensor == P_LN1W || tensor == P_LN2W || tensor == P_LNFW) ? 1.0f : 0.0f;
    size_t real_rows = (size_t)cfg->vocab_size * (size_t)cfg->channels;
    /* each value is a pure function of (seed, tensor, element): safe to split across threads */
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        size_t e = start + i;
        if (std == 0.0f || ((tensor == P_WTE || tensor == P_LMHEAD) && e >= real_rows)) out[i] = fill;
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
    int version;       /* 3 / 7: fp32 payload, 5 / 8: bf16 payload (7, 8: the configurable family) */
    size_t num_params; /* elements in the payload */
    float pdrop[MODEL_NUM_PDROP];
} ModelFileInfo;

#define MODEL_SWITCHES_END 240 /* slots 240-244: run id and dropout */
static inline int model_version_has_switches(int version) { return version == 7 || version == 8; }
static inline int model_version_elem_bytes(int version) { return version == 3 || version == 7 ? 4 : 2; }

static inline int slot_is_float(int slot) {
    return slot == SLOT_NORM_EPS || slot == SLOT_ROPE_THETA || slot == SLOT_ROPE_FACTOR || slot == SLOT_ROPE_LOW ||
           slot == SLOT_ROPE_HIGH || slot == SLOT_ROPE_ATTN_FACTOR;
}

static inline float slot_float(const int32_t* h, int slot) {
    float v;
    memcpy(&v, &h[slot], 4);
    return v;
}

static inline void slot_set_float(int32_t* h, int slot, float v) { memcpy(&h[slot], &v, 4); }

static inline void model_header_write_switches(int32_t* h, const ModelConfig* c) {
    ModelConfig r = config_resolved(c);
    h[SLOT_FAMILY] = r.family;
    h[SLOT_NKV] = r.num_kv_heads;
    h[SLOT_HD] = r.head_size;
    h[SLOT_FFN] = r.ffn;
    h[SLOT_NORM] = r.norm;
    slot_set_float(h, SLOT_NORM_EPS, r.norm_eps);
    h[SLOT_POSITIONS] = r.positions;
    slot_set_float(h, SLOT_ROPE_THETA, r.rope_theta);
    h[SLOT_ROPE_SCALING] = r.rope_scaling;
    slot_set_float(h, SLOT_ROPE_FACTOR, r.rope_factor);
    slot_set_float(h, SLOT_ROPE_LOW, r.rope_low);
    slot_set_float(h, SLOT_ROPE_HIGH, r.rope_high);
    h[SLOT_ROPE_ORIGINAL_MAX] = r.rope_original_max;
    slot_set_float(h, SLOT_ROPE_ATTN_FACTOR, r.rope_attn_factor);
    h[SLOT_MLP] = r.mlp;
    h[SLOT_BIAS] = r.bias;
    h[SLOT_TIED] = r.tied;
    h[SLOT_BOS] = r.bos;
    h[SLOT_EOS] = r.eos;
    h[SLOT_HF_MAX_POS] = r.hf_max_positions;
}

/* Reads slots 8-27 into cfg; the slots after them up to the dropout's
 * (28-239) must be 0 and every fp32 slot finite. A problem goes into
 * why[n], naming the slot; returns -1 then. The values' ranges are
 * config_problem's. */
static inline int model_header_read_switches(const int32_t* h, ModelConfig* c, const char* path, char* why, size_t n) {
    for (int slot = SLOT_FAMILY; slot < SLOT_FIRST_UNUSED; slot++)
        if (slot_is_float(slot) && !isfinite(slot_float(h, slot))) {
            snprintf(why, n, "%s: header slot %d (%s) is %g: not a finite number", path, slot, model_slot_names[slot - SLOT_FAMILY],
                     (double)slot_float(h, slot));
            return -1;
        }
    for (int slot = SLOT_FIRST_UNUSED; slot < MODEL_SWITCHES_END; slot++)
        if (h[slot] != 0) {
            snprintf(why, n, "%s: header slot %d is %d: slots %d-%d are unused and must be 0 (a newer writer?)", path, slot, h[slot],
                     SLOT_FIRST_UNUSED, MODEL_SWITCHES_END - 1);
            return -1;
        }
    c->family = h[SLOT_FAMILY];
    c->num_kv_heads = h[SLOT_NKV];
    c->head_size = h[SLOT_HD];
    c->ffn = h[SLOT_FFN];
    c->norm = h[SLOT_NORM];
    c->norm_eps = slot_float(h, SLOT_NORM_EPS);
    c->positions = h[SLOT_POSITIONS];
    c->rope_theta = slot_float(h, SLOT_ROPE_THETA);
    c->rope_scaling = h[SLOT_ROPE_SCALING];
    c->rope_factor = slot_float(h, SLOT_ROPE_FACTOR);
    c->rope_low = slot_float(h, SLOT_ROPE_LOW);
    c->rope_high = slot_float(h, SLOT_ROPE_HIGH);
    c->rope_original_max = h[SLOT_ROPE_ORIGINAL_MAX];
    c->rope_attn_factor = slot_float(h, SLOT_ROPE_ATTN_FACTOR);
    c->mlp = h[SLOT_MLP];
    c->bias = h[SLOT_BIAS];
    c->tied = h[SLOT_TIED];
    c->bos = h[SLOT_BOS];
    c->eos = h[SLOT_EOS];
    c->hf_max_positions = h[SLOT_HF_MAX_POS];
    if (c->family == FAMILY_UNSET) { /* 0 would read as "no switches": name the slot instead */
        snprintf(why, n, "%s: header slot %d (family) is 0: expected 1 gpt2, 2 llama or 3 qwen2", path, SLOT_FAMILY);
        return -1;
    }
    return 0;
}

/* Opens a model file and validates its header and exact size; the stream
 * is positioned at the payload. NULL, with the reason in why[n], when the
 * file cannot be opened or is not a whole model file. */
static inline FILE* model_file_try_open(const char* path, ModelFileInfo* info, char* why, size_t n) {
    int32_t h[256];
    size_t elem = 0; /* declared before the gotos: C++ (nvcc) refuses a jump past an initialisation */
    int slot = 0;
    char size_why[96];
    FILE* f = header_file_open(path, h, "model file", why, n);
    if (!f) return NULL;
    if (h[0] != MODEL_MAGIC) { snprintf(why, n, "%s: bad magic %d (expected %d: not an llm.c model file)", path, h[0], MODEL_MAGIC); goto bad; }
    if (h[1] != 3 && h[1] != 5 && h[1] != 7 && h[1] != 8) {
        snprintf(why, n, "%s: unsupported model file version %d (expected 3 or 5, GPT-2; 7 or 8, the configurable family)", path, h[1]);
        goto bad;
    }
    info->version = h[1];
    memset(&info->cfg, 0, sizeof(info->cfg));
    info->cfg.max_seq_len = h[2];
    info->cfg.vocab_size = h[3];
    info->cfg.num_layers = h[4];
    info->cfg.num_heads = h[5];
    info->cfg.channels = h[6];
    info->cfg.padded_vocab_size = h[7];
    if (model_version_has_switches(h[1]) && model_header_read_switches(h, &info->cfg, path, why, n)) goto bad;
    if (config_problem_slot(&info->cfg, path, why, n, &slot)) {
        if (slot) { /* a switch: say which header slot holds it */
            char what[4400];
            snprintf(what, sizeof(what), "%s: header slot %d (%s)", path, slot, model_slot_names[slot - SLOT_FAMILY]);
            config_problem_slot(&info->cfg, what, why, n, &slot);
        }
        goto bad;
    }
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
    elem = model_version_elem_bytes(info->version);
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
    if (model_version_elem_bytes(info->version) == 4) {
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
    size_t elem = model_version_elem_bytes(info->version);
    if (fseeko(f, (off_t)(1024 + first * elem), SEEK_SET) != 0) fail("%s: seek failed (%s)", path, strerror(errno));
    model_file_read_chunk(f, info, out, n, path);
}

/* The version a model of configuration cfg is written as, for a payload
 * of fp32 (bf16 = 0) or bf16: GPT-2's 3/5, else 7/8. */
static inline int model_file_version_for(const ModelConfig* cfg, int bf16) {
    if (config_is_gpt2(cfg)) return bf16 ? 5 : 3;
    return bf16 ? 8 : 7;
}

/* version: the payload's type as 3 (fp32) or 5 (bf16), or 7/8; the
 * configurable family's switches promote 3/5 to 7/8 (model_file_version_for). */
static inline void model_file_write_header(FILE* f, const ModelConfig* cfg, int version, const float* pdrop, const char* path) {
    int32_t h[256];
    memset(h, 0, sizeof(h));
    version = model_file_version_for(cfg, model_version_elem_bytes(version) == 2);
    h[0] = MODEL_MAGIC;
    h[1] = version;
    h[2] = cfg->max_seq_len;
    h[3] = cfg->vocab_size;
    h[4] = cfg->num_layers;
    h[5] = cfg->num_heads;
    h[6] = cfg->channels;
    h[7] = cfg->padded_vocab_size;
    if (model_version_has_switches(version)) model_header_write_switches(h, cfg);
    memcpy(&h[MODEL_DROPOUT_SLOT], pdrop, MODEL_NUM_PDROP * sizeof(float));
    fwrite_check(h, sizeof(int32_t), 256, f, path);
}

/* Writes n fp32 parameters as version `version` payload. For bf16 the input
 * chunk is converted in place into its own first half. */
static inline void model_file_write_chunk(FILE* f, int version, float* chunk, size_t n, const char* path) {
    if (model_version_elem_bytes(version) == 4) {
        fwrite_check(chunk, sizeof(float), n, f, path);
        return;
    }
    uint16_t* half = (uint16_t*)chunk;
    for (size_t i = 0; i < n; i++) half[i] = float_to_bf16(chunk[i]);
    fwrite_check(half, sizeof(uint16_t), n, f, path);
}

/* RoPE's per-pair frequencies from a configuration, the one table both
 * trainers turn by (train_gpt.c's rope_rotate, llmc/cuda/rope.cuh). In
 * double: fp32 angles drift by about 0.06 rad at position 10^6. */

/* yarn's dimension index at which a wavelength fits `rotations` turns into the original context. */
static inline double yarn_correction_dim(double rotations, int dim, double base, double original_max) {
    return dim * log(original_max / (rotations * 2 * M_PI)) / (2 * log(base));
}

/* inv_freq (HD/2) and the attention factor of a configuration (transformers'
 * modeling_rope_utils semantics for default, linear, llama3 and yarn with
 * truncated correction bounds). */
static inline void rope_frequencies(const ModelConfig* c, double* inv_freq, double* mscale) {
    int half = c->head_size / 2, dim = c->head_size;
    double base = c->rope_theta, factor = c->rope_factor, orig = c->rope_original_max;
    *mscale = 1;
    for (int j = 0; j < half; j++) inv_freq[j] = 1.0 / pow(base, (double)(2 * j) / dim);
    if (c->rope_scaling == ROPE_LINEAR)
        for (int j = 0; j < half; j++) inv_freq[j] /= factor;
    if (c->rope_scaling == ROPE_LLAMA3) {
        /* long wavelengths (beyond orig / low) slow down by factor, short ones
         * (below orig / high) stay, those between ramp smoothly */
        double low_wavelen = orig / c->rope_low, high_wavelen = orig / c->rope_high;
        for (int j = 0; j < half; j++) {
            double wavelen = 2 * M_PI / inv_freq[j];
            if (wavelen > low_wavelen) inv_freq[j] /= factor;
            else if (wavelen >= high_wavelen) {
                double smooth = (orig / wavelen - c->rope_low) / (c->rope_high - c->rope_low);
                inv_freq[j] = (1 - smooth) * inv_freq[j] / factor + smooth * inv_freq[j];
            }
        }
    }
    if (c->rope_scaling == ROPE_YARN) {
        /* beta_fast (rope_low) and beta_slow (rope_high) turns bound the ramp
         * from extrapolated (unchanged) to interpolated (slowed by factor) */
        double lo = floor(yarn_correction_dim(c->rope_low, dim, base, orig));
        double hi = ceil(yarn_correction_dim(c->rope_high, dim, base, orig));
        if (lo < 0) lo = 0;
        if (hi > dim - 1) hi = dim - 1;
        if (lo == hi) hi += 0.001;
        for (int j = 0; j < half; j++) {
            double ramp = ((double)j - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            double extrapolate = 1 - ramp;
            inv_freq[j] = inv_freq[j] / factor * (1 - extrapolate) + inv_freq[j] * extrapolate;
        }
        *mscale = c->rope_attn_factor > 0 ? c->rope_attn_factor : factor <= 1 ? 1.0 : 0.1 * log(factor) + 1.0;
    }
}

#endif
