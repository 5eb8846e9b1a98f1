/*
 * Command-line flags of both trainers.
 *
 * One table drives both the parser and --help, so the help text cannot drift
 * from what the parser accepts. Values are parsed strictly: a flag's whole
 * argument must be a number in range, or the run stops naming the flag.
 */
#ifndef REMAT_CLI_H
#define REMAT_CLI_H

#include <stddef.h>
#include <limits.h>
#include <math.h>
#include "utils.h"
#include "model.h" /* DROPOUT_MAX_P */

#define TRAIN_MAX_FLAGS 96

typedef struct {
    /* model */
    const char* model;  /* -e: model file or descriptor d6 d12 d24 d36 d48 */
    int layers, heads, channels, max_seq_len, vocab_size;
    /* data */
    const char* train_glob;
    const char* val_glob;
    const char* tokenizer_path;
    int shuffle;
    /* packed documents (llmc/core/documents.h) */
    int reset_attention_mask, reset_position_ids, eod_mask_loss;
    int eot_token; /* -1: the tokenizer file's, else 50256 for GPT-2's vocabulary */
    int plan_doc_len; /* the time model's document length with --reset-attention-mask (0: none) */
    /* batch */
    int B, T, total_batch_tokens;
    int max_steps;
    /* optimizer */
    float lr, final_lr_frac, weight_decay, beta1, beta2, eps, grad_clip;
    const char* schedule;
    int warmup_steps;
    /* evaluation and sampling */
    int val_every, val_batches, sample_every, gen_tokens;
    const char* eval_by_position; /* position buckets: a width W (doubling from it), or edges E0,E1,...; "0": off */
    const char* eval_dump;        /* per-token validation results to this file ("": none) */
    const char* prompt;
    const char* prompt_tokens;
    float temperature;
    int top_k;
    const char* wpe_init;
    const char* rope_scaling; /* TYPE:FACTOR for a RoPE model file a longer --max-seq-len extends ("": none) */
    /* memory */
    const char* recompute;
    const char* recompute_layers;
    int plan_only, plan_json, plan_processes;
    const char* mem_budget;
    const char* cost_model;
    int offload_checkpoints;
    int offload_optimizer; /* --offload-optimizer: master weights, moments and a gradient copy in host memory */
    const char* tile_tokens_flag; /* --tile-tokens as typed: 0, K or auto */
    int tile_tokens;              /* resolved rows per token tile (0: untiled); a hyperparameter of the state */
    const char* segment_layers_flag; /* --segment-layers as typed: K or auto */
    int segment_layers;              /* resolved layers per segment (1: off) */
    const char* host_mem_budget;
    const char* host_link;
    int zero_stage, master_weights;
    int context_parallel; /* N: processes that share each sequence (1: off) */
    const char* ring_link; /* the time model's link for the ring: nvlink|infiniband|mpi ("": the trainer's default) */
    /* regularisation: dropout probabilities (below 0: not given; resolved in trainer.h) */
    float dropout, attn_dropout, resid_dropout, embd_dropout;
    /* checkpoints and output */
    const char* out_dir;
    int checkpoint_every, resume;
    int supersede, resume_override, keep_last, keep_every;
    int collective_timeout_s;
    int seed;
    /* given[i]: flag_table[i] was typed (a flag whose value equals its
     * default still counts: an ignored flag is reported either way) */
    unsigned char given[TRAIN_MAX_FLAGS];
} TrainOptions;

typedef enum { FLAG_INT, FLAG_FLOAT, FLAG_STRING, FLAG_SWITCH } FlagType;
enum { FOR_BOTH = 3, FOR_CPU = 1, FOR_GPU = 2 };

typedef struct {
    const char* name; /* as typed: "-b" or "--beta1" */
    FlagType type;
    size_t offset;
    double min, max;  /* numeric range, inclusive */
    int trainers;     /* FOR_CPU, FOR_GPU or FOR_BOTH */
    const char* help;
} FlagSpec;

/* The default data (not in the repository: dev/data/tinyshakespeare.py makes it) */
#define DEFAULT_TRAIN_GLOB "data/tinyshakespeare/tiny_shakespeare_train.bin"
#define DEFAULT_VAL_GLOB "data/tinyshakespeare/tiny_shakespeare_val.bin"

#define OPT(field) offsetof(TrainOptions, field)
static const FlagSpec flag_table[] = {
    {"-e", FLAG_STRING, OPT(model), 0, 0, FOR_BOTH, "model: a model file (v3 fp32 or v5 bf16 GPT-2; v7 fp32 or v8 bf16 the configurable family: Llama, Qwen2), or for random init d6|d12|d24|d36|d48 (GPT-2) or a preset with the shape of a Hugging Face config.json: smollm2-135m|qwen2.5-0.5b|qwen2.5-1.5b|qwen2.5-7b|llama3.2-1b|llama3.2-3b|llama3.1-8b (the GPU trainer: the family with NH x HD = C, unverified on GPU)"},
    {"--layers", FLAG_INT, OPT(layers), 1, 4096, FOR_BOTH, "random init: number of layers (overrides the descriptor)"},
    {"--heads", FLAG_INT, OPT(heads), 1, 65536, FOR_BOTH, "random init: number of attention heads"},
    {"--channels", FLAG_INT, OPT(channels), 1, 65536, FOR_BOTH, "random init: channels C"},
    {"--max-seq-len", FLAG_INT, OPT(max_seq_len), 1, 4194304, FOR_BOTH, "rows of the position table; with a model file: resize it (long-context fine-tuning)"},
    {"--rope-scaling", FLAG_STRING, OPT(rope_scaling), 0, 0, FOR_BOTH, "context extension of a RoPE model file (Llama, Qwen2) that a longer --max-seq-len lengthens: TYPE:FACTOR with TYPE linear, llama3 (low_freq_factor 1, high_freq_factor 4) or yarn (beta_fast 32, beta_slow 1, attention factor 0.1 ln FACTOR + 1), the original length being the file's; stored in the model files the run writes (a model that already has a scaling is refused)"},
    {"--wpe-init", FLAG_STRING, OPT(wpe_init), 0, 0, FOR_BOTH, "how the rows a longer --max-seq-len adds to a model file's position table start, required then (neither is better for every model: docs/finetune_long.md measures both): interpolate (the learned rows stretched linearly over the new length) or tile (row t = learned row t mod maxT: position 0's row recurs at maxT, 2maxT, ...)"},
    {"--vocab-size", FLAG_INT, OPT(vocab_size), 2, 262144, FOR_BOTH, "random init: vocabulary size V (padded to a multiple of 128)"},
    {"-i", FLAG_STRING, OPT(train_glob), 0, 0, FOR_BOTH, "training token shards (glob)"},
    {"-j", FLAG_STRING, OPT(val_glob), 0, 0, FOR_BOTH, "validation token shards (glob; empty string: no validation)"},
    {"--tokenizer", FLAG_STRING, OPT(tokenizer_path), 0, 0, FOR_BOTH, "tokenizer file for decoding samples (default: *tokenizer.bin beside the train shards, else gpt2_tokenizer.bin)"},
    {"--shuffle", FLAG_INT, OPT(shuffle), 0, 1, FOR_BOTH, "1: shuffle shard order and batch order each epoch"},
    {"--reset-attention-mask", FLAG_SWITCH, OPT(reset_attention_mask), 0, 1, FOR_BOTH, "packed documents: a token attends only to earlier tokens of its own document (a document starts at an end-of-text token, or at a row's start); attention skips the work across documents"},
    {"--reset-position-ids", FLAG_SWITCH, OPT(reset_position_ids), 0, 1, FOR_BOTH, "packed documents: positions restart at 0 at each document's start (its end-of-text token)"},
    {"--eod-mask-loss", FLAG_SWITCH, OPT(eod_mask_loss), 0, 1, FOR_BOTH, "packed documents: no loss where the input token is end of text (its prediction has no context); the loss is the mean over the tokens counted"},
    {"--eot-token", FLAG_INT, OPT(eot_token), -1, 262143, FOR_BOTH, "the end-of-text token that starts each document, for the three flags above (-1: the tokenizer file's, else 50256 with GPT-2's vocabulary)"},
    {"--plan-doc-len", FLAG_INT, OPT(plan_doc_len), 0, 4194304, FOR_BOTH, "with --reset-attention-mask: the time model of --plan and -r auto assumes documents of N tokens packed back to back, so attention attends their pairs only (0: the whole causal triangle)"},
    {"-b", FLAG_INT, OPT(B), 1, 1 << 20, FOR_BOTH, "batch size B (per process)"},
    {"-t", FLAG_INT, OPT(T), 1, 4194304, FOR_BOTH, "sequence length T (up to 4194304 in either trainer, whatever --context-parallel: train_gpt's offsets past 2^31 elements are 64-bit)"},
    {"-d", FLAG_INT, OPT(total_batch_tokens), -1, INT_MAX, FOR_BOTH, "total tokens per optimizer step, all processes (-1: B*T*groups); must be a multiple of B*T*groups, groups = processes / --context-parallel"},
    {"-x", FLAG_INT, OPT(max_steps), -1, INT_MAX, FOR_BOTH, "optimizer steps (-1: one epoch of the training data; 0: only evaluate and sample the model: no training data is read, and with -o the model evaluated, resized if --max-seq-len resized it, is written as model_00000000.bin; with no validation, no samples and no -o: refused)"},
    {"-l", FLAG_FLOAT, OPT(lr), 0, 10, FOR_BOTH, "peak learning rate"},
    {"-k", FLAG_STRING, OPT(schedule), 0, 0, FOR_BOTH, "learning-rate schedule: cosine|linear|constant"},
    {"-u", FLAG_INT, OPT(warmup_steps), 0, INT_MAX, FOR_BOTH, "linear warmup steps"},
    {"-q", FLAG_FLOAT, OPT(final_lr_frac), 0, 1, FOR_BOTH, "final learning rate as a fraction of the peak (cosine, linear)"},
    {"-c", FLAG_FLOAT, OPT(weight_decay), 0, 10, FOR_BOTH, "AdamW weight decay (2-D weights only)"},
    {"--beta1", FLAG_FLOAT, OPT(beta1), 0, 0.999999, FOR_BOTH, "AdamW beta1"},
    {"--beta2", FLAG_FLOAT, OPT(beta2), 0, 0.999999, FOR_BOTH, "AdamW beta2"},
    {"--eps", FLAG_FLOAT, OPT(eps), 1e-30, 1, FOR_BOTH, "AdamW epsilon"},
    {"--grad-clip", FLAG_FLOAT, OPT(grad_clip), 0, 1e30, FOR_BOTH, "clip the global gradient norm to this (0: off)"},
    {"-v", FLAG_INT, OPT(val_every), 0, INT_MAX, FOR_BOTH, "validate every N steps (0: never)"},
    {"-m", FLAG_INT, OPT(val_batches), 1, INT_MAX, FOR_BOTH, "validation batches per evaluation (at most)"},
    {"-s", FLAG_INT, OPT(sample_every), 0, INT_MAX, FOR_BOTH, "sample every N steps (0: never)"},
    {"-g", FLAG_INT, OPT(gen_tokens), 1, 1048576, FOR_BOTH, "tokens to generate per sample (at most T minus the context: one end-of-text token and the prompt)"},
    {"--prompt", FLAG_STRING, OPT(prompt), 0, 0, FOR_BOTH, "start samples from this text (tokenized by python3 dev/data/prompt.py beside the trainer)"},
    {"--prompt-tokens", FLAG_STRING, OPT(prompt_tokens), 0, 0, FOR_BOTH, "start samples from the token ids in this file (a token shard, or ids separated by spaces or commas)"},
    {"--temperature", FLAG_FLOAT, OPT(temperature), 0, 100, FOR_BOTH, "sampling temperature (0: always the most probable token)"},
    {"--top-k", FLAG_INT, OPT(top_k), 0, 65536, FOR_BOTH, "sample only among the K most probable tokens (0: all)"},
    {"--eval-by-position", FLAG_STRING, OPT(eval_by_position), 0, 0, FOR_BOTH, "also report validation loss and top-1 accuracy per position bucket: W gives [0,W), [W,2W), [2W,4W), ... (1024: 0-1k, 1k-2k, 2k-4k), every:W buckets of width W, a list E0,E1,...,En the buckets [E0,E1), ..., [En-1,En) (positions outside are not counted; up to 256 buckets); 0: off. Validation rows are contiguous: row r's last target is row r+1's first token"},
    {"--eval-dump", FLAG_STRING, OPT(eval_dump), 0, 0, FOR_BOTH, "write every validation token's target, top-1 prediction, loss and position (-1: not counted) to this file (its directory must exist) at each evaluation (docs/FORMATS.md; read by dev/plot_log.py --dump and dev/data/passkey.py)"},
    {"-r", FLAG_STRING, OPT(recompute), 0, 0, FOR_BOTH, "activation recompute: 0 keep all, 1 full per layer, 2 selective, 3 full but attention kept, auto (fastest predicted that fits --mem-budget, with the token tile size unless --tile-tokens gives one), or per layer MODE:LAYERS/... like 1:0-3/3:4-11 (layers not named: 0); MODEo (1o, 3o) offloads that group's kept tensors to host memory"},
    {"--recompute-layers", FLAG_STRING, OPT(recompute_layers), 0, 0, FOR_BOTH, "layers -r 1 or -r 3 applies to (the others keep everything): all|none|N (first N)|every:K|list like 0,2,5-7"},
    {"--plan", FLAG_SWITCH, OPT(plan_only), 0, 1, FOR_BOTH, "print the memory plan and the fit of each recompute mode, then exit"},
    {"--plan-json", FLAG_SWITCH, OPT(plan_json), 0, 1, FOR_BOTH, "print the memory plan as one JSON object, then exit"},
    {"--plan-processes", FLAG_INT, OPT(plan_processes), 0, 65536, FOR_BOTH, "--plan, --plan-json: plan for this many processes (per-process bytes; with -z 1 the optimizer state is sharded; 0: the processes running)"},
    {"--mem-budget", FLAG_STRING, OPT(mem_budget), 0, 0, FOR_BOTH, "memory budget for --plan and -r auto, e.g. 79GiB, 24000MiB, used as given (no headroom kept); default: free GPU memory less 256 MiB, or available host memory within cgroup and ulimit -v limits"},
    {"--offload-checkpoints", FLAG_SWITCH, OPT(offload_checkpoints), 0, 1, FOR_BOTH, "keep what -r 1 and -r 3 layers keep (their input; -r 3 also attention's output) in host memory, copied out after the layer's forward and back during the backward; with -r auto: let it choose which layers offload"},
    {"--offload-optimizer", FLAG_SWITCH, OPT(offload_optimizer), 0, 1, FOR_BOTH, "keep the optimizer in host memory: the fp32 master weights (a host copy of the parameters without -w 1), AdamW's two moments and a copy of the gradients live in the host pool (inside --host-mem-budget), AdamW runs on the host, the updated parameters are copied back (on a GPU with one process: during the next forward, layer by layer); on a GPU with one process and one micro-step the device keeps the gradients of two layers in flight and of the tensors outside the blocks only; the same bits as without it; with -r auto: let it choose where the optimizer lives"},
    {"--tile-tokens", FLAG_STRING, OPT(tile_tokens_flag), 0, 0, FOR_BOTH, "token tiles: LayerNorms, matmuls, GELU and residual adds over K of the B*T rows at a time, so the recompute set's token-wise tensors hold K rows (0: off; auto: the size -r auto would choose, untiled or a power of two (down to one row), the least predicted time that fits --mem-budget; not given: -r auto chooses it and prints it)"},
    {"--segment-layers", FLAG_STRING, OPT(segment_layers_flag), 0, 0, FOR_BOTH, "segment checkpointing: keep only the input of the first layer of each segment of K layers and, in the backward, run a segment's forward again from it before its layers' backward; the -r modes apply inside a segment (-r 1: about L/K + K kept inputs, 2 sqrt(L) at K = sqrt(L), for one more forward of all but the top segment); --offload-checkpoints then offloads the segment inputs (1: off; auto: the K -r auto would choose; not given: -r auto chooses it and prints it)"},
    {"--host-mem-budget", FLAG_STRING, OPT(host_mem_budget), 0, 0, FOR_BOTH, "host memory for offloaded checkpoints and --offload-optimizer's host pool (--plan, -r auto, and a run's check), e.g. 120GiB; default: available host memory within cgroup and ulimit -v limits"},
    {"--host-link", FLAG_STRING, OPT(host_link), 0, 0, FOR_BOTH, "device-host link of the time model, for offloading: pcie4|pcie5|nvlink-c2c or bytes/s per direction like 40e9 (default: the cost model's, measured in a file REMAT_PROFILE_COST_MODEL wrote)"},
    {"--cost-model", FLAG_STRING, OPT(cost_model), 0, 0, FOR_BOTH, "time model of --plan and -r auto: cpu|a100|h100|h200|gh200 or a calibration file, e.g. one REMAT_PROFILE_COST_MODEL wrote (default: cpu for train_gpt_cpu; train_gpt: its GPU's, else h100)"},
    {"-z", FLAG_INT, OPT(zero_stage), 0, 1, FOR_BOTH, "ZeRO stage: 0 none, 1 shard optimizer state across processes"},
    {"--context-parallel", FLAG_INT, OPT(context_parallel), 1, 65536, FOR_BOTH, "processes that share each sequence (context parallelism: each holds 2 of its 2N chunks, attention runs as a ring); T must be divisible by 2N, N must divide the processes, -b counts sequences per group of N"},
    {"--ring-link", FLAG_STRING, OPT(ring_link), 0, 0, FOR_BOTH, "link the time model prices the context-parallel ring on: nvlink|infiniband|mpi (default: the --cost-model file's measured link, else mpi for train_gpt_cpu, nvlink for train_gpt)"},
    {"-w", FLAG_INT, OPT(master_weights), 0, 1, FOR_GPU, "1: keep fp32 master weights (low-precision builds)"},
    {"--dropout", FLAG_FLOAT, OPT(dropout), 0, DROPOUT_MAX_P, FOR_BOTH, "dropout probability at all three sites: embedding, attention probabilities, residual branches (unset: the model file's, else 0)"},
    {"--attn-dropout", FLAG_FLOAT, OPT(attn_dropout), 0, DROPOUT_MAX_P, FOR_BOTH, "dropout on the attention probabilities (Hugging Face's attn_pdrop; unset: --dropout, else the model file's, else 0)"},
    {"--resid-dropout", FLAG_FLOAT, OPT(resid_dropout), 0, DROPOUT_MAX_P, FOR_BOTH, "dropout on both residual branches, after the attention and MLP projections (resid_pdrop; unset: as --attn-dropout)"},
    {"--embd-dropout", FLAG_FLOAT, OPT(embd_dropout), 0, DROPOUT_MAX_P, FOR_BOTH, "dropout on the token + position embedding (embd_pdrop; unset: as --attn-dropout)"},
    {"-o", FLAG_STRING, OPT(out_dir), 0, 0, FOR_BOTH, "output directory for checkpoints and log.jsonl (empty: none)"},
    {"-n", FLAG_INT, OPT(checkpoint_every), 0, INT_MAX, FOR_BOTH, "write a checkpoint every N steps (0: only at the end, if -o). SIGINT and SIGTERM checkpoint the step they stop; a run killed otherwise (kill -9, out of memory) before its first checkpoint keeps nothing: for long steps give an N that is soon reached"},
    {"-y", FLAG_INT, OPT(resume), 0, 1, FOR_BOTH, "1: resume from the latest complete checkpoint in -o"},
    {"--supersede", FLAG_SWITCH, OPT(supersede), 0, 1, FOR_BOTH, "a fresh run into an -o that holds checkpoints: delete them (else refused)"},
    {"--resume-override", FLAG_SWITCH, OPT(resume_override), 0, 1, FOR_BOTH, "-y 1: continue with hyperparameters that differ from the checkpoint's (else refused)"},
    {"-nk", FLAG_INT, OPT(keep_last), 0, INT_MAX, FOR_BOTH, "keep only the last N checkpoints (0: all), besides those -nm keeps"},
    {"-nm", FLAG_INT, OPT(keep_every), 0, INT_MAX, FOR_BOTH, "with -nk: also keep every checkpoint whose step is a multiple of N (0: none)"},
    {"--collective-timeout", FLAG_INT, OPT(collective_timeout_s), 0, 604800, FOR_BOTH, "seconds a rank waits in a collective (MPI or NCCL) before it stops the job naming the rank it waited for (0: forever)"},
    {"--seed", FLAG_INT, OPT(seed), 0, INT_MAX, FOR_BOTH, "seed for init, shuffling and sampling"},
};
#undef OPT
#define NUM_FLAGS ((int)(sizeof(flag_table) / sizeof(flag_table[0])))
#ifdef __cplusplus /* the CUDA trainer compiles this as C++ */
static_assert(NUM_FLAGS <= TRAIN_MAX_FLAGS, "TrainOptions.given is too small for the flag table");
#else
_Static_assert(NUM_FLAGS <= TRAIN_MAX_FLAGS, "TrainOptions.given is too small for the flag table");
#endif

/* Whether flag `name` (as in the table) was typed. */
static inline int option_given(const TrainOptions* o, const char* name) {
    for (int i = 0; i < NUM_FLAGS; i++)
        if (strcmp(flag_table[i].name, name) == 0) return o->given[i];
    return 0;
}

/* Whether `trainer` (FOR_CPU or FOR_GPU) has flag `name`. */
static inline int flag_for_trainer(const char* name, int trainer) {
    for (int i = 0; i < NUM_FLAGS; i++)
        if (strcmp(flag_table[i].name, name) == 0) return (flag_table[i].trainers & trainer) != 0;
    return 0;
}

static inline void options_defaults(TrainOptions* o) {
    memset(o, 0, sizeof(*o));
    o->model = "d12";
    o->train_glob = DEFAULT_TRAIN_GLOB;
    o->val_glob = DEFAULT_VAL_GLOB;
    o->tokenizer_path = "";
    o->eot_token = -1;
    o->B = 4;
    o->T = 1024;
    o->total_batch_tokens = -1;
    o->max_steps = -1;
    o->lr = 3e-4f;
    o->schedule = "cosine";
    o->final_lr_frac = 1.0f;
    o->beta1 = 0.9f;
    o->beta2 = 0.95f;
    o->eps = 1e-8f;
    o->grad_clip = 1.0f;
    o->val_every = 20;
    o->val_batches = 20;
    o->sample_every = 20;
    o->gen_tokens = 64;
    o->prompt = "";
    o->prompt_tokens = "";
    o->temperature = 1.0f;
    o->wpe_init = "";
    o->rope_scaling = "";
    o->eval_by_position = "0";
    o->eval_dump = "";
    o->recompute = "0";
    o->recompute_layers = "all";
    o->mem_budget = "";
    o->cost_model = "";
    o->host_mem_budget = "";
    o->tile_tokens_flag = "0";
    o->segment_layers_flag = "1";
    o->host_link = "";
    o->master_weights = 1;
    o->context_parallel = 1;
    o->ring_link = "";
    o->dropout = o->attn_dropout = o->resid_dropout = o->embd_dropout = -1.0f;
    o->out_dir = "";
    o->seed = 1337;
}

static inline void format_default(const TrainOptions* d, const FlagSpec* f, char* buf, size_t n) {
    const char* base = (const char*)d + f->offset;
    switch (f->type) {
    case FLAG_INT: /* a default below the range: the shape flags, whose default is -e's */
        if (*(const int*)base < f->min) snprintf(buf, n, "from -e");
        else snprintf(buf, n, "%d", *(const int*)base);
        break;
    case FLAG_FLOAT: /* a default below the range: not given unless typed */
        if (*(const float*)base < f->min) snprintf(buf, n, "unset");
        else snprintf(buf, n, "%g", (double)*(const float*)base);
        break;
    case FLAG_STRING: snprintf(buf, n, "\"%s\"", *(const char* const*)base); break;
    case FLAG_SWITCH: snprintf(buf, n, "off"); break;
    }
}

static inline void print_usage(const char* prog, int trainer) {
    TrainOptions d;
    options_defaults(&d);
    printf("usage: %s [flags]\n\nflags (default in brackets):\n", prog);
    for (int i = 0; i < NUM_FLAGS; i++) {
        const FlagSpec* f = &flag_table[i];
        if (!(f->trainers & trainer)) continue;
        char def[96];
        format_default(&d, f, def, sizeof(def));
        const char* arg = f->type == FLAG_SWITCH ? "" : f->type == FLAG_STRING ? " S" : f->type == FLAG_INT ? " N" : " X";
        char head[48];
        snprintf(head, sizeof(head), "%s%s", f->name, arg);
        printf("  %-22s %s [%s]\n", head, f->help, def);
    }
    printf("  %-22s show this help\n", "-h, --help");
    if (trainer != FOR_CPU) return;
    /* OpenMP's own variables, whose defaults the CPU trainer sets (llmc/cpu/cpu_threads.h) */
    printf("\nenvironment (each, when set, overrides the trainer's default; neither changes the results' bits):\n");
    printf("  %-22s OpenMP threads [the CPUs this process may run on (its affinity), at most the cgroup's CPU quota; under an MPI "
           "launcher, the launcher's placement]\n", "OMP_NUM_THREADS=N");
    printf("  %-22s passive: idle threads sleep at once, which holds up when other jobs share the cores; active: they spin, a little "
           "faster on cores of its own [passive, unless GOMP_SPINCOUNT is set; under an MPI launcher, the OpenMP runtime's]\n",
           "OMP_WAIT_POLICY=S");
}

/* Whether s starts as a number written plainly: a digit, or '-' then a
 * digit (or '.', with `fraction`), or '.' with `fraction`. strtol and strtod
 * alone would also take leading spaces and '+' (" 2", "+64"), and strtod
 * hexadecimal ("0x10"): none is what the docs call a value. */
static inline int number_starts_plainly(const char* s, int fraction) {
    const char* d = s[0] == '-' ? s + 1 : s;
    if (!((*d >= '0' && *d <= '9') || (fraction && *d == '.'))) return 0;
    for (const char* c = s; *c && fraction; c++)
        if (*c == 'x' || *c == 'X') return 0;
    return 1;
}

static inline void parse_flag_value(const FlagSpec* f, const char* val, TrainOptions* o) {
    char* end = NULL;
    void* field = (char*)o + f->offset;
    if (f->type == FLAG_STRING) { *(const char**)field = val; return; }
    errno = 0;
    if (f->type == FLAG_INT) {
        long v = strtol(val, &end, 10);
        if (end == val || *end != '\0' || errno == ERANGE || !number_starts_plainly(val, 0))
            fail("flag %s: '%s' is not an integer", f->name, val);
        if ((double)v < f->min || (double)v > f->max) fail("flag %s: %ld out of range [%.0f, %.0f]", f->name, v, f->min, f->max);
        *(int*)field = (int)v;
    } else {
        double v = strtod(val, &end);
        if (end == val || *end != '\0' || errno == ERANGE || !isfinite(v) || !number_starts_plainly(val, 1))
            fail("flag %s: '%s' is not a number", f->name, val);
        if (v < f->min || v > f->max) fail("flag %s: %g out of range [%g, %g]", f->name, v, f->min, f->max);
        *(float*)field = (float)v;
    }
}

/* Whether -r's value is a per-layer mix like 1:0-3/3:4-11. */
static inline int recompute_is_mix(const char* r) { return strchr(r, ':') != NULL; }

/* Flags that would be ignored in combination with others: refused, so that
 * no flag a user types is silently without effect. (Those that depend on the
 * model or the checkpoint are checked where those are known.) */
static inline void check_flag_combinations(const TrainOptions* o) {
    const char* r = o->recompute;
    if (option_given(o, "--recompute-layers") && strcmp(r, "1") != 0 && strcmp(r, "3") != 0)
        fail("flag --recompute-layers: applies to -r 1 and -r 3 only (this run gives -r %s%s)", r,
             strcmp(r, "auto") == 0 ? ", which chooses every layer's mode itself" : recompute_is_mix(r) ? ", a per-layer mix whose groups name the layers" : "");
    if (option_given(o, "-nm") && o->keep_last == 0)
        fail("flag -nm: applies with -nk N (keep only the last N checkpoints); without -nk every checkpoint is kept");
    if (o->plan_doc_len && !o->reset_attention_mask)
        fail("flag --plan-doc-len: applies with --reset-attention-mask (without it attention attends every causal pair)");
    if (option_given(o, "--eot-token") && !o->reset_attention_mask && !o->reset_position_ids && !o->eod_mask_loss)
        fail("flag --eot-token: applies with --reset-attention-mask, --reset-position-ids or --eod-mask-loss (none is given)");
    if (o->resume_override && !o->resume) fail("flag --resume-override: applies to -y 1 only (a fresh run has no checkpoint to differ from)");
}

/* Parses argv into o (defaults first). Prints help and exits 0 on -h. */
static inline void parse_args(int argc, char** argv, TrainOptions* o, int trainer) {
    options_defaults(o);
    for (int i = 1; i < argc; i++) {
        const char* a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) { print_usage(argv[0], trainer); exit(0); }
        const FlagSpec* f = NULL;
        for (int k = 0; k < NUM_FLAGS; k++)
            if (strcmp(flag_table[k].name, a) == 0) f = &flag_table[k];
        if (!f) fail("unknown flag '%s' (see --help)", a);
        if (!(f->trainers & trainer))
            fail("flag %s: %s trainer only (%s)", a, f->trainers == FOR_GPU ? "GPU" : "CPU",
                 f->trainers == FOR_GPU ? "train_gpt" : "train_gpt_cpu");
        o->given[f - flag_table] = 1;
        if (f->type == FLAG_SWITCH) { *(int*)((char*)o + f->offset) = 1; continue; }
        if (i + 1 >= argc) fail("flag %s needs a value", a);
        parse_flag_value(f, argv[++i], o);
    }
    if (strcmp(o->schedule, "cosine") && strcmp(o->schedule, "linear") && strcmp(o->schedule, "constant"))
        fail("flag -k: unknown schedule '%s' (cosine, linear or constant)", o->schedule);
    if (strcmp(o->recompute, "0") && strcmp(o->recompute, "1") && strcmp(o->recompute, "2") && strcmp(o->recompute, "3") &&
        strcmp(o->recompute, "auto") && !recompute_is_mix(o->recompute))
        fail("flag -r: '%s' is not 0, 1, 2, 3, auto or a per-layer mix like 1:0-3/3:4-11", o->recompute);
    if (o->ring_link[0] && strcmp(o->ring_link, "nvlink") && strcmp(o->ring_link, "infiniband") && strcmp(o->ring_link, "mpi"))
        fail("flag --ring-link: '%s' is not nvlink, infiniband or mpi", o->ring_link);
    if (option_given(o, "--wpe-init") && strcmp(o->wpe_init, "tile") && strcmp(o->wpe_init, "interpolate"))
        fail("flag --wpe-init: '%s' is not tile or interpolate", o->wpe_init);
    if (o->prompt[0] && o->prompt_tokens[0]) fail("flags --prompt and --prompt-tokens: give one of them, not both");
    if (o->resume && o->out_dir[0] == '\0') fail("flag -y 1 needs an output directory -o to resume from");
    if (o->resume && o->supersede) fail("flags -y 1 and --supersede contradict each other (resume the checkpoints, or delete them)");
    if (strcmp(o->tile_tokens_flag, "auto") != 0) {
        char* end = NULL;
        errno = 0;
        long k = strtol(o->tile_tokens_flag, &end, 10);
        if (end != o->tile_tokens_flag && !*end && (errno == ERANGE || k > INT_MAX))
            fail("flag --tile-tokens: %s is more than 2^31-1 = 2147483647, the most tokens a tile (or a micro-step) can hold",
                 o->tile_tokens_flag);
        if (end == o->tile_tokens_flag || *end || errno == ERANGE || k < 0 || !number_starts_plainly(o->tile_tokens_flag, 0))
            fail("flag --tile-tokens: '%s' is not 0, a positive number of tokens, or auto", o->tile_tokens_flag);
        o->tile_tokens = (int)k;
    }
    o->segment_layers = 1;
    if (strcmp(o->segment_layers_flag, "auto") != 0) {
        char* end = NULL;
        errno = 0;
        long k = strtol(o->segment_layers_flag, &end, 10);
        if (end == o->segment_layers_flag || *end || errno == ERANGE || k < 1 || k > INT_MAX ||
            !number_starts_plainly(o->segment_layers_flag, 0))
            fail("flag --segment-layers: '%s' is not a positive number of layers, or auto", o->segment_layers_flag);
        o->segment_layers = (int)k;
    }
    if (o->offload_checkpoints && recompute_is_mix(o->recompute) && strcmp(o->segment_layers_flag, "1") == 0)
        fail("flags --offload-checkpoints and the mix -r %s: mark offloaded groups in the mix instead (like 1o:0-3)", o->recompute);
    if (o->plan_processes && !o->plan_only && !o->plan_json)
        fail("flag --plan-processes only applies to --plan and --plan-json (a run uses the processes it is started with)");
    check_flag_combinations(o);
}

/* Parses a byte size such as 80GiB, 80GB, 512MiB, 1e9: binary and decimal
 * units, case-insensitive; bare numbers are bytes. Returns 0 for "". */
static inline size_t parse_bytes(const char* flag, const char* s) {
    if (s[0] == '\0') return 0;
    char* end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    /* strtod also reads hexadecimal ("0x10": 16 bytes), which no one means as a size */
    int decimal = (s[0] >= '0' && s[0] <= '9') || s[0] == '.';
    for (const char* c = s; c < end; c++) decimal &= *c != 'x' && *c != 'X';
    if (end == s || !decimal || errno == ERANGE || !isfinite(v) || v <= 0)
        fail("flag %s: '%s' is not a positive size like 80GiB", flag, s);
    static const struct { const char* unit; double mult; } units[] = {
        {"", 1}, {"b", 1}, {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0},
        {"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12}, {"k", 1024.0}, {"m", 1048576.0}, {"g", 1073741824.0}};
    char unit[8] = {0};
    size_t n = strlen(end);
    if (n >= sizeof(unit)) fail("flag %s: unknown unit in '%s' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", flag, s);
    for (size_t i = 0; i < n; i++) unit[i] = (char)((end[i] >= 'A' && end[i] <= 'Z') ? end[i] + 32 : end[i]);
    for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
        if (strcmp(unit, units[i].unit) == 0) {
            double bytes = v * units[i].mult;
            if (bytes >= 1.8e19) fail("flag %s: '%s' is too large", flag, s);
            if (bytes < 1.0) fail("flag %s: '%s' is less than one byte", flag, s);
            return (size_t)bytes;
        }
    }
    fail("flag %s: unknown unit in '%s' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", flag, s);
    return 0;
}

/* ORs a layer list like 0,2,5-7 (layers and inclusive ranges) of `flag`'s
 * value `whole` into mask; stops at the end of the string or at `stop`. */
static inline const char* parse_layer_list(const char* flag, const char* whole, const char* p, char stop, int L, unsigned char* mask) {
    char* end = NULL;
    if (*p == '\0' || *p == stop) fail("flag %s: empty layer list in '%s'", flag, whole);
    while (*p && *p != stop) {
        long a = strtol(p, &end, 10);
        if (end == p || a < 0 || !number_starts_plainly(p, 0)) fail("flag %s: '%s' is not all, none, N, every:K or a list like 0,2,5-7", flag, whole);
        long b = a;
        p = end;
        if (*p == '-') {
            const char* q = p + 1;
            b = strtol(q, &end, 10);
            if (end == q || b < a || !number_starts_plainly(q, 0)) fail("flag %s: bad range in '%s'", flag, whole);
            p = end;
        }
        if (*p == ',') p++;
        else if (*p && *p != stop) fail("flag %s: unexpected '%c' in '%s'", flag, *p, whole);
        if (b >= L) fail("flag %s: layer %ld out of range (the model has %d layers)", flag, b, L);
        for (long l = a; l <= b; l++) mask[l] = 1;
    }
    return p;
}

/* Parses --recompute-layers into a 0/1 mask over L layers. */
static inline void parse_layer_set(const char* spec, int L, unsigned char* mask) {
    memset(mask, 0, (size_t)L);
    if (strcmp(spec, "all") == 0) { memset(mask, 1, (size_t)L); return; }
    if (strcmp(spec, "none") == 0) return;
    char* end = NULL;
    if (strncmp(spec, "every:", 6) == 0) {
        long k = strtol(spec + 6, &end, 10);
        if (end == spec + 6 || *end || k < 1 || k > L || !number_starts_plainly(spec + 6, 0))
            fail("flag --recompute-layers: '%s': every:K needs K in [1, %d] (the model's layers)", spec, L);
        for (long l = 0; l < L; l += k) mask[l] = 1;
        return;
    }
    if (strchr(spec, ',') == NULL && strchr(spec, '-') == NULL) { /* a single number N means the first N layers */
        long n = strtol(spec, &end, 10);
        if (end == spec || *end || n < 0 || !number_starts_plainly(spec, 0)) fail("flag --recompute-layers: '%s' is not all, none, N, every:K or a list like 0,2,5-7", spec);
        if (n > L) fail("flag --recompute-layers: %ld layers requested, the model has %d", n, L);
        memset(mask, 1, (size_t)n);
        return;
    }
    parse_layer_list("--recompute-layers", spec, spec, '\0', L, mask);
}

/* Per-layer recompute modes (0..3) and offload flags from -r and
 * --recompute-layers: one mode for every layer (-r 1 and -r 3 only on
 * --recompute-layers' layers, the others keep everything), or a mix
 * MODE:LAYERS/MODE:LAYERS/... with the layers in list form (0,2,5-7) or all,
 * MODE 1o or 3o offloading the group; layers it does not name keep
 * everything (-r 0). -r auto leaves every layer at 0 for the planner. */
static inline void parse_recompute(const char* r, const char* layers, int L, unsigned char* modes, unsigned char* offload) {
    memset(modes, 0, (size_t)L);
    memset(offload, 0, (size_t)L);
    if (strcmp(r, "auto") == 0 || strcmp(r, "0") == 0) return;
    if (strcmp(r, "2") == 0) { memset(modes, 2, (size_t)L); return; }
    if (!recompute_is_mix(r)) { /* 1 or 3, checked by parse_args */
        parse_layer_set(layers, L, modes);
        for (int l = 0; l < L; l++) modes[l] = modes[l] ? (unsigned char)(r[0] - '0') : 0;
        return;
    }
    if (strcmp(layers, "all") != 0)
        fail("flag --recompute-layers: not with the per-layer mix -r %s (its groups name the layers)", r);
    unsigned char* named = (unsigned char*)calloc_check((size_t)L, 1, "recompute modes");
    unsigned char* group = (unsigned char*)malloc_check((size_t)L, "recompute modes");
    for (const char* p = r; *p;) {
        int off = p[0] != '\0' && p[1] == 'o';
        if (p[0] < '0' || p[0] > '3' || p[1 + off] != ':')
            fail("flag -r: '%s': each group is MODE:LAYERS with MODE 0-3 (1o, 3o: offloaded), groups separated by / (like 1:0-3/3:4-11)", r);
        unsigned char mode = (unsigned char)(p[0] - '0');
        if (off && mode != 1 && mode != 3) /* plan.h's mode_can_offload: full recompute, and full with attention kept */
            fail("flag -r: '%s': only -r 1 and -r 3 layers offload (%do: the layer keeps its activations on the device)", r, mode);
        p += 2 + off;
        memset(group, 0, (size_t)L);
        if (strncmp(p, "all", 3) == 0 && (p[3] == '\0' || p[3] == '/')) { memset(group, 1, (size_t)L); p += 3; }
        else p = parse_layer_list("-r", r, p, '/', L, group);
        for (int l = 0; l < L; l++) {
            if (!group[l]) continue;
            if (named[l]) fail("flag -r: '%s' names layer %d twice", r, l);
            named[l] = 1;
            modes[l] = mode;
            offload[l] = (unsigned char)off;
        }
        if (*p == '/' && *++p == '\0') fail("flag -r: '%s' ends with /", r);
    }
    free(group);
    free(named);
}

#endif
