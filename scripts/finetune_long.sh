#!/usr/bin/env bash
# Long-context fine-tuning of a saved model: its position table is resized to
# SEQ_LEN rows (--max-seq-len; the new rows start as WPE_INIT says), the memory plan of every
# recompute mode is printed against the budget, and training runs with -r auto: of the recompute plans that fit,
# the one the time model (--cost-model) predicts fastest. Batch size 1 (unless -b is given); more tokens per step come
# from gradient accumulation (-d), which costs time, not memory.
#
# Usage: scripts/finetune_long.sh MODEL.bin SEQ_LEN [trainer flags]
#   scripts/finetune_long.sh out/d12/model_00005000.bin 16384
#   CONTEXT_PARALLEL=4 scripts/finetune_long.sh out/d12/model_00005000.bin 65536
#   MEM_BUDGET=40GiB scripts/finetune_long.sh gpt2_124M.bin 8192 -x 500 -l 5e-5
# Flags given after SEQ_LEN come last, so they override the defaults below.
#
# Environment:
#   TRAINER          the binary (default: the repository's train_gpt when
#                    nvidia-smi lists a GPU, else its train_gpt_cpu; built with
#                    make when missing).
#                    train_gpt: see the status table in README.md.
#   MEM_BUDGET       memory to fit in, e.g. 130GiB (default: the GPU's free
#                    memory less 256 MiB; for train_gpt_cpu, available host
#                    memory within cgroup and ulimit -v limits).
#   TRAIN, VAL       token shard globs (default the repository's tiny
#                    Shakespeare; VAL="" for no validation).
#   OUT_DIR          checkpoints and log.jsonl (default out/long_SEQ_LEN, under
#                    the directory the script is run from).
#   TOKENS_PER_STEP  -d (default: the multiple of B*SEQ_LEN*groups nearest above
#                    65536; groups = PROCESSES / CONTEXT_PARALLEL).
#   CONTEXT_PARALLEL N: processes that share each sequence (--context-parallel;
#                    default 1). SEQ_LEN must be a multiple of 2N; each process
#                    holds SEQ_LEN/N tokens of each sequence and its activations.
#                    train_gpt runs it too (built with MPI and NCCL; unverified
#                    on GPUs: docs/context-parallel.md).
#   PROCESSES        processes to start (default CONTEXT_PARALLEL); more form
#                    data-parallel groups of CONTEXT_PARALLEL.
#   LAUNCHER         how to start them (default "mpirun -np PROCESSES" when
#                    PROCESSES > 1; e.g. LAUNCHER="srun -n 8" under Slurm).
#   WPE_INIT         interpolate (default: the learned rows stretched over SEQ_LEN,
#                    the usual choice for a pretrained GPT-2's smooth table) or tile
#                    (row t = learned row t mod the old length); docs/finetune_long.md
#                    measures both. Used only when SEQ_LEN lengthens the table.
#   ROPE_SCALING     for a RoPE model (Llama, Qwen2: model file version 7 or 8),
#                    which has no table: --rope-scaling TYPE:FACTOR when SEQ_LEN
#                    is longer than the file's length (default: none, positions
#                    beyond it as they are).
#   PASSKEY          a directory dev/data/passkey.py make wrote at SEQ_LEN: passkey
#                    retrieval by distance is printed for the resized model before
#                    training and for the last checkpoint after it.
# Checkpoints: every 100 steps (-n 100), and on SIGINT/SIGTERM; a run killed
# otherwise before its first checkpoint keeps nothing (at long T a step can
# take minutes: give a smaller -n to keep more).
# Relative paths (MODEL, TRAIN, VAL, OUT_DIR, TRAINER) are taken from the
# directory the script is run from.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)

usage() { echo "usage: scripts/finetune_long.sh MODEL.bin SEQ_LEN [trainer flags]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
model=$1 seq_len=$2
shift 2
[[ -f "$model" ]] || { echo "finetune_long: model file '$model' not found" >&2; exit 1; }
[[ "$seq_len" =~ ^[1-9][0-9]*$ ]] || { echo "finetune_long: SEQ_LEN '$seq_len' is not a positive integer" >&2; exit 1; }

if [[ -z "${TRAINER:-}" ]]; then
    if nvidia-smi -L >/dev/null 2>&1; then TRAINER=$repo/train_gpt; else TRAINER=$repo/train_gpt_cpu; fi
    [[ -x "$TRAINER" ]] || make -C "$repo" "$(basename "$TRAINER")"
fi
[[ -x "$TRAINER" ]] || { echo "finetune_long: TRAINER '$TRAINER' is not an executable" >&2; exit 1; }

train=${TRAIN:-$repo/data/tinyshakespeare/tiny_shakespeare_train.bin}
val=${VAL-$repo/data/tinyshakespeare/tiny_shakespeare_val.bin}
if [[ -z "${TRAIN:-}" && ! -f "$train" ]]; then
    echo "finetune_long: the default data $train is missing: make it with python3 $repo/dev/data/tinyshakespeare.py, or set TRAIN and VAL" >&2
    exit 1
fi

# Tokens per step: the multiple of B*SEQ_LEN nearest above 65536 (B: the last -b given, else 1).
batch=1
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i++)); do [[ "${args[i]}" == "-b" ]] && batch=${args[i + 1]}; done
[[ "$batch" =~ ^[1-9][0-9]*$ ]] || { echo "finetune_long: -b '$batch' is not a positive integer" >&2; exit 1; }
cp=${CONTEXT_PARALLEL:-1}
procs=${PROCESSES:-$cp}
[[ "$cp" =~ ^[1-9][0-9]*$ && "$procs" =~ ^[1-9][0-9]*$ ]] || { echo "finetune_long: CONTEXT_PARALLEL '$cp' and PROCESSES '$procs' must be positive integers" >&2; exit 1; }
(( procs % cp == 0 )) || { echo "finetune_long: CONTEXT_PARALLEL $cp does not divide PROCESSES $procs" >&2; exit 1; }
launcher=()
if (( procs > 1 )); then read -r -a launcher <<< "${LAUNCHER:-mpirun -np $procs}"; fi
micro=$(( batch * seq_len * (procs / cp) ))
tokens_per_step=${TOKENS_PER_STEP:-$(( (65536 + micro - 1) / micro * micro ))}
# The plan and the run share these, so the plan predicts the run's step time (-d: its micro-steps).
common=(-e "$model" --max-seq-len "$seq_len" -t "$seq_len" -b 1 -i "$train" -j "$val" -o "${OUT_DIR:-out/long_$seq_len}"
        -r auto -d "$tokens_per_step" --context-parallel "$cp")
[[ -z "${MEM_BUDGET:-}" ]] || common+=(--mem-budget "$MEM_BUDGET")
# the model's position table rows: header slot 2 (docs/FORMATS.md)
rows=$(od -An -t d4 -j 8 -N 4 "$model" | tr -d ' ')
# RoPE: header slot 14 of a version 7 or 8 file (slot 1) is 1
version=$(od -An -t d4 -j 4 -N 4 "$model" | tr -d ' ')
rope=0
if [[ "$version" == 7 || "$version" == 8 ]]; then rope=$(od -An -t d4 -j 56 -N 4 "$model" | tr -d ' '); fi
lengthen=()
if (( seq_len > rows && rope == 1 )); then
    [[ -z "${ROPE_SCALING:-}" ]] || lengthen=(--rope-scaling "$ROPE_SCALING")
elif (( seq_len > rows )); then
    lengthen=(--wpe-init "${WPE_INIT:-interpolate}")
fi
common+=(${lengthen[@]+"${lengthen[@]}"})

# What each recompute mode costs at this length, and the largest B and T that
# fit: per process, planned for all of them by one.
"$TRAINER" "${common[@]}" --plan --plan-processes "$procs" "$@"
echo
# Passkey retrieval of a model at SEQ_LEN, with the run's processes and recompute.
passkey() {
    [[ -n "${PASSKEY:-}" ]] || return 0
    local eval=("$TRAINER" -e "$1" --max-seq-len "$seq_len" --context-parallel "$cp" -r auto "${@:3}")
    [[ -z "${MEM_BUDGET:-}" ]] || eval+=(--mem-budget "$MEM_BUDGET")
    echo "passkey retrieval, $2:"
    python3 "$repo/dev/data/passkey.py" eval "$PASSKEY" -- ${launcher[@]+"${launcher[@]}"} "${eval[@]}"
    echo
}
passkey "$model" "the resized model before training" ${lengthen[@]+"${lengthen[@]}"}
# Fine-tuning defaults: a low peak learning rate with warmup, cosine to 10%,
# a checkpoint every 100 steps (resume with -y 1).
${launcher[@]+"${launcher[@]}"} "$TRAINER" "${common[@]}" -l 1e-4 -u 20 -q 0.1 -c 0.1 -v 50 -m 4 -s 0 -n 100 "$@"
last=$(ls "${OUT_DIR:-out/long_$seq_len}"/model_*.bin 2>/dev/null | sort | tail -n 1)
[[ -z "$last" ]] || passkey "$last" "after training ($last)"
