/*
 * Parameters in and out of the backend: the model file or random init at
 * start, model files and checkpoints (llmc/core/checkpoint.h's state file) during
 * the run, and resume.
 */
#ifndef REMAT_RUN_CHECKPOINTS_H
#define REMAT_RUN_CHECKPOINTS_H

#include "backend.h"

/* A model file's values must be finite: a NaN or Inf would evaluate to a
 * NaN loss or stop training as if it had diverged. `first` is the index in
 * the tensor of x[0]. */
static inline void check_loaded_finite(const float* x, size_t n, const char* path, int tensor, size_t first) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            fail("%s: parameter tensor %s element %zu is %g: a model file must hold finite values", path, param_tensor_names[tensor],
                 first + i, (double)x[i]);
}

/* Copies n parameters of tensor t from file element `from` to backend
 * element `to`, in chunks; `first` is the index in the tensor of the first. */
static inline void copy_from_file(Backend* be, FILE* f, const ModelFileInfo* info, int t, size_t first, size_t from, size_t to,
                                  size_t n, size_t chunk, const char* path) {
    for (size_t s = 0; s < n; s += chunk) {
        size_t k = n - s < chunk ? n - s : chunk;
        model_file_read_at(f, info, from + s, be->io_chunk, k, path);
        check_loaded_finite(be->io_chunk, k, path, t, first + s);
        be->transfer(be->ctx, TENSOR_PARAMS, to + s, k, be->io_chunk, 0);
    }
}

/* Row r of a position table of `rows` rows interpolated linearly from the
 * file's `file_rows` learned rows, whose first and last rows stay in place. */
static inline void interpolate_position_row(const float* table, size_t file_rows, size_t rows, size_t r, size_t C, float* out) {
    double pos = rows > 1 ? (double)r * (double)(file_rows - 1) / (double)(rows - 1) : 0.0;
    size_t lo = (size_t)pos, hi = lo + 1 < file_rows ? lo + 1 : lo;
    float frac = (float)(pos - (double)lo);
    for (size_t c = 0; c < C; c++) out[c] = table[lo * C + c] * (1.0f - frac) + table[hi * C + c] * frac;
}

/* The position table when --max-seq-len lengthened it, interpolated: the
 * file's table is read whole, the new one sent a chunk of rows at a time. */
static inline void load_interpolated_positions(Run* run, Backend* be, FILE* f, const ModelFileInfo* info, size_t from,
                                               size_t to, size_t chunk) {
    size_t C = (size_t)run->cfg.channels, file_rows = (size_t)info->cfg.max_seq_len, rows = (size_t)run->cfg.max_seq_len;
    float* table = (float*)malloc_check(file_rows * C * sizeof(float), "position table");
    model_file_read_at(f, info, from, table, file_rows * C, run->model_path);
    check_loaded_finite(table, file_rows * C, run->model_path, P_WPE, 0);
    size_t rows_per_chunk = chunk / C;
    for (size_t r = 0; r < rows; r += rows_per_chunk) {
        size_t k = rows - r < rows_per_chunk ? rows - r : rows_per_chunk;
        for (size_t i = 0; i < k; i++) interpolate_position_row(table, file_rows, rows, r + i, C, be->io_chunk + i * C);
        be->transfer(be->ctx, TENSOR_PARAMS, to + r * C, k * C, be->io_chunk, 0);
    }
    free(table);
}

/* Parameters from the model file, tensor by tensor. When --max-seq-len
 * resized the position table, a shorter one keeps the first rows; a longer
 * one (long-context fine-tuning) starts, with --wpe-init tile, with row t =
 * the file's row t mod maxT (the learned positions repeated), or with
 * --wpe-init interpolate, the learned rows stretched over the new length. */
static inline void load_parameters_from_file(Run* run, Backend* be, size_t chunk) {
    ModelFileInfo info;
    FILE* f = model_file_open(run->model_path, &info);
    ParamLayout file_pl, run_pl;
    param_layout(&info.cfg, &file_pl);
    param_layout(&run->cfg, &run_pl);
    size_t C = (size_t)run->cfg.channels, file_rows = (size_t)info.cfg.max_seq_len, rows = (size_t)run->cfg.max_seq_len;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (run_pl.count[t] == 0) continue; /* a tensor the switches leave out (RoPE: no position table) */
        if (t != P_WPE) {
            copy_from_file(be, f, &info, t, 0, file_pl.offset[t], run_pl.offset[t], run_pl.count[t], chunk, run->model_path);
        } else if (rows > file_rows && strcmp(run->opt.wpe_init, "interpolate") == 0) {
            load_interpolated_positions(run, be, f, &info, file_pl.offset[t], run_pl.offset[t], chunk);
        } else {
            for (size_t r = 0; r < rows;) {
                size_t src = r % file_rows, k = file_rows - src < rows - r ? file_rows - src : rows - r;
                copy_from_file(be, f, &info, t, src * C, file_pl.offset[t] + src * C, run_pl.offset[t] + r * C, k * C, chunk,
                               run->model_path);
                r += k;
            }
        }
    }
    fclose(f);
}

static inline void load_parameters(Run* run, Backend* be) {
    size_t chunk = run->io_chunk_floats / 2; /* half: bf16 staging */
    if (run->model_path) { load_parameters_from_file(run, be, chunk); return; }
    ParamLayout pl;
    param_layout(&run->cfg, &pl);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++)
        for (size_t s = 0; s < pl.count[t]; s += chunk) {
            size_t n = pl.count[t] - s < chunk ? pl.count[t] - s : chunk;
            param_init_chunk(&run->cfg, (uint64_t)run->opt.seed, t, s, n, be->io_chunk);
            be->transfer(be->ctx, TENSOR_PARAMS, pl.offset[t] + s, n, be->io_chunk, 0);
        }
}

static const char* const state_tensor_names[4] = {"parameters", "master weights", "AdamW m", "AdamW v"};

/* A state about to be saved must be finite: a non-finite one (an update that
 * diverged, the last one included) stops the run before any checkpoint of
 * it is complete. The values pass through host memory on their way to the
 * file anyway, so on the GPU too this costs no extra transfer. */
static inline void check_finite_chunk(const float* x, size_t n, int tensor, size_t first, int step, AtomicFile* af) {
    for (size_t i = 0; i < n; i++) {
        if (isfinite(x[i])) continue;
        if (af) atomic_abort(af);
        fail("step %d: %s element %zu is %g: the training state diverged (lower -l, or keep --grad-clip on); no checkpoint "
             "of it is written", step, state_tensor_names[tensor], first + i, (double)x[i]);
    }
}

/* Streams a state tensor of n elements from element `start` between a file
 * (af's when writing, f when reading) and the backend. */
static inline void stream_tensor(Run* run, Backend* be, int tensor, size_t start, size_t n, FILE* f, const char* path,
                                 AtomicFile* af, int step) {
    size_t chunk = run->io_chunk_floats;
    for (size_t s = 0; s < n; s += chunk) {
        size_t k = n - s < chunk ? n - s : chunk;
        if (af) {
            be->transfer(be->ctx, tensor, start + s, k, be->io_chunk, 1);
            check_finite_chunk(be->io_chunk, k, tensor, start + s, step, af);
            fwrite_check(be->io_chunk, 4, k, af->f, path);
        } else {
            fread_check(be->io_chunk, 4, k, f, path);
            for (size_t i = 0; i < k; i++)
                if (!isfinite(be->io_chunk[i]))
                    fail("%s: %s element %zu is %g: a checkpoint's state must hold finite values", path, state_tensor_names[tensor],
                         start + s + i, (double)be->io_chunk[i]);
            be->transfer(be->ctx, tensor, start + s, k, be->io_chunk, 0);
        }
    }
}

static inline void save_model_file(Run* run, Backend* be, const char* path, int step) {
    AtomicFile af;
    atomic_open(&af, path);
    /* the run's dropout goes with the model, as save_pretrained's config does (a resume reads it back) */
    const float pdrop[MODEL_NUM_PDROP] = {run->opt.embd_dropout, run->opt.attn_dropout, run->opt.resid_dropout};
    model_file_write_header(af.f, &run->cfg, be->model_file_version, pdrop, path);
    int32_t id_slots[2];
    put64(id_slots, 0, run->run_id);
    fseek_check(af.f, 4L * MODEL_RUN_ID_SLOT, SEEK_SET, af.tmp_path);
    fwrite_check(id_slots, 4, 2, af.f, af.tmp_path);
    fseek_check(af.f, 1024, SEEK_SET, af.tmp_path);
    size_t n_total = run->plan.num_params, chunk = run->io_chunk_floats;
    for (size_t s = 0; s < n_total; s += chunk) {
        size_t n = n_total - s < chunk ? n_total - s : chunk;
        be->transfer(be->ctx, TENSOR_PARAMS, s, n, be->io_chunk, 1);
        check_finite_chunk(be->io_chunk, n, TENSOR_PARAMS, s, step, &af);
        model_file_write_chunk(af.f, be->model_file_version, be->io_chunk, n, path);
    }
    atomic_commit(&af);
}

/* Without -o nothing is saved, but a run that ends with a non-finite model
 * still must not exit 0. */
static inline void check_parameters_finite(Run* run, Backend* be, int step) {
    size_t n_total = run->plan.num_params, chunk = run->io_chunk_floats;
    for (size_t s = 0; s < n_total; s += chunk) {
        size_t n = n_total - s < chunk ? n_total - s : chunk;
        be->transfer(be->ctx, TENSOR_PARAMS, s, n, be->io_chunk, 1);
        check_finite_chunk(be->io_chunk, n, TENSOR_PARAMS, s, step, NULL);
    }
}


/* The parameters whose optimizer state this rank holds: all of them, or its
 * ZeRO-1 shard. */
static inline void run_shard(const Run* run, size_t* start, size_t* count) {
    if (run->plan.shard_params == run->plan.num_params) { *start = 0; *count = run->plan.num_params; return; }
    shard_range(run->plan.num_params, run->world, run->rank, start, count);
}

static inline void save_checkpoint(Run* run, Backend* be, int step, const DataLoader* loader) {
    const char* dir = run->opt.out_dir;
    char path[4200];
    if (run->rank == 0) {
        checkpoint_path(path, sizeof(path), dir, "model", step, -1);
        save_model_file(run, be, path, step);
    }
    TrainState st;
    memset(&st, 0, sizeof(st));
    st.step = step; st.world = run->world; st.rank = run->rank; st.zero_stage = run->opt.zero_stage;
    st.has_master = run->plan.spec.master_weights; st.B = run->opt.B; st.T = run->opt.T;
    st.context_parallel = run->cp.group_size;
    st.loader = dataloader_get_state(loader);
    st.num_params = run->plan.num_params;
    run_shard(run, &st.shard_start, &st.shard_params);
    st.loss_scale = run->scaler.scale;
    st.clean_steps = run->scaler.clean_steps;
    st.updates = run->updates;
    st.device = be->device;
    st.run_id = run->run_id;
    hparams_pack(&run->opt, &run->hp, st.hparams);
    st.data = run->data;
    checkpoint_path(path, sizeof(path), dir, "state", step, run->rank);
    AtomicFile af;
    atomic_open(&af, path);
    state_header_write(af.f, &st, path);
    stream_tensor(run, be, TENSOR_ADAM_M, st.shard_start, st.shard_params, NULL, path, &af, step);
    stream_tensor(run, be, TENSOR_ADAM_V, st.shard_start, st.shard_params, NULL, path, &af, step);
    if (st.has_master) stream_tensor(run, be, TENSOR_MASTER, st.shard_start, st.shard_params, NULL, path, &af, step);
    atomic_commit(&af);
    proc_barrier("the checkpoint barrier"); /* complete only when every rank has written */
    if (run->rank == 0) {
        checkpoint_write_marker(dir, step, run->run_id);
        checkpoint_retain(dir, run->opt.keep_last, run->opt.keep_every);
    }
    printf("checkpoint: step %d written to %s\n", step, dir);
}

/* -x 0 -o: the model evaluated (its position table as --max-seq-len resized
 * it) as a model file of step 0, for hf_gpt2.py export or a later -e. Not a
 * checkpoint: there is no optimizer state to resume. */
static inline void save_evaluated_model(Run* run, Backend* be, int step) {
    char path[4200];
    checkpoint_path(path, sizeof(path), run->opt.out_dir, "model", step, -1);
    if (run->rank == 0) save_model_file(run, be, path, step);
    proc_barrier("the barrier after saving the evaluated model");
    printf("model: the model evaluated written to %s (-x 0: no optimizer state, not a checkpoint to resume)\n", path);
}

/* A resume on another GPU model or library version continues correctly but
 * not bitwise as the run would have without stopping: say so, once. */
static inline void warn_if_other_device(const DeviceRecord* saved, const DeviceRecord* now, const char* path) {
    if (!saved->name[0] || device_record_equal(saved, now)) return;
    char a[200], b[200];
    device_record_format(saved, a, sizeof(a));
    device_record_format(now, b, sizeof(b));
    fprintf(stderr, "warning: %s was written on %s; this run is on %s: it continues, but is not bitwise the run that did not stop"
                    " (cuBLASLt and NCCL choose by GPU model and version)\n", path, a, b);
}

/* Restores optimizer state and data position; the parameters were loaded
 * from the checkpoint's model file. Returns the step to continue after. */
static inline int load_checkpoint(Run* run, Backend* be, DataLoader* loader) {
    char path[4200];
    TrainState st;
    checkpoint_path(path, sizeof(path), run->opt.out_dir, "state", run->resume_step, 0);
    fclose(state_open(path, &st));
    if (st.world != run->world)
        fail("%s: checkpoint written by %d process%s; resume needs the same number (this run has %d)", path, st.world,
             st.world == 1 ? "" : "es", run->world);
    checkpoint_path(path, sizeof(path), run->opt.out_dir, "state", run->resume_step, run->rank);
    FILE* f = state_open(path, &st);
    if (st.world != run->world)
        fail("%s: checkpoint written by %d process%s; resume needs the same number (this run has %d)", path, st.world,
             st.world == 1 ? "" : "es", run->world);
    /* the data position counts global batches of (groups x B) rows of T: those must match, not B alone */
    int saved_rows = st.B * (st.world / st.context_parallel), rows = run->opt.B * run->cp.groups;
    if (st.T != run->opt.T || saved_rows != rows) {
        if (st.context_parallel == 1 && run->cp.group_size == 1)
            fail("%s: checkpoint written with B=%d T=%d; resume needs the same (-b %d -t %d given)", path, st.B, st.T, run->opt.B, run->opt.T);
        fail("%s: checkpoint written with T=%d and %d sequences per micro-step (-b %d, --context-parallel %d); resume needs the "
             "same T and sequences per micro-step (-b x processes / --context-parallel; this run: -t %d, %d x %d / %d = %d)", path,
             st.T, saved_rows, st.B, st.context_parallel, run->opt.T, run->opt.B, run->world, run->cp.group_size, rows);
    }
    if (st.zero_stage != run->opt.zero_stage) fail("%s: checkpoint written with -z %d; resume needs the same", path, st.zero_stage);
    size_t my_start, my_count;
    run_shard(run, &my_start, &my_count);
    if (st.num_params != run->plan.num_params || st.shard_params != my_count || st.shard_start != my_start)
        fail("%s: parameter count or shard does not match this run", path);
    if (st.has_master != run->plan.spec.master_weights) fail("%s: checkpoint master-weight setting (-w) differs from this run", path);
    if (!(st.loss_scale >= 1.0f) || st.clean_steps < 0 || st.updates < 0 || st.updates > st.step)
        fail("%s: corrupt loss-scaler or step state in the header", path);
    if (st.run_id != run->run_id)
        fail("%s: written by run %016llx, its DONE marker names run %016llx: the checkpoint mixes two runs' files", path,
             (unsigned long long)st.run_id, (unsigned long long)run->run_id);
    hparams_check(&run->opt, &run->hp, st.hparams, path);
    if (run->rank == 0 && loader->num_shards) data_record_check(&run->opt, &st.data, &run->data, path); /* none: -x 0 */
    run->scaler.scale = st.loss_scale;
    run->scaler.clean_steps = st.clean_steps;
    run->updates = st.updates;
    warn_if_other_device(&st.device, &be->device, path);
    stream_tensor(run, be, TENSOR_ADAM_M, st.shard_start, st.shard_params, f, path, NULL, 0);
    stream_tensor(run, be, TENSOR_ADAM_V, st.shard_start, st.shard_params, f, path, NULL, 0);
    if (st.has_master) stream_tensor(run, be, TENSOR_MASTER, st.shard_start, st.shard_params, f, path, NULL, 0);
    fclose(f);
    if (loader->num_shards) dataloader_set_state(loader, st.loader, path);
    printf("resumed: step %d from %s\n", st.step, run->opt.out_dir);
    return st.step;
}

#endif
