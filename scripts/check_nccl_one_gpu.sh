#!/usr/bin/env bash
# One-GPU check of the multi-GPU build: the NCCL path (llmc/cuda/multigpu.cuh) runs
# with one rank and gives exactly the losses, gradient norms and validation
# losses of the plain single-process build. One GPU exercises everything but
# the arithmetic of a sum over ranks: NCCL setup, the per-layer gradient
# reductions on their own stream during the last micro-step's backward (and
# the after-backward variant), ZeRO-1's reduce-to-owner and in-place
# all-gather, the shard-local optimizer state, and a checkpoint resume with it.
# Status: written without a GPU; what it checks is unverified until it passes.
#
# Usage: scripts/check_nccl_one_gpu.sh   (PREC=bf16|fp16|fp32, default bf16;
#        LOGDIR=dir keeps the runs' logs there, default a temporary folder)
# Exit: 0 all equal, 1 a difference or failure, 77 skipped (no NCCL/MPI build,
# or no CUDA device).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PREC=${PREC:-bf16}
NCCL_BIN=build/train_gpt_$PREC
PLAIN_BIN=build/train_gpt_nompi_$PREC
# Decide before compiling anything: without NCCL and MPI there is nothing to check.
if ! make -s cuda-info | grep -q '^multi-GPU.*: on'; then
    echo "SKIP: no NCCL/MPI build here ($(make -s cuda-info | grep multi-GPU))"
    exit 77
fi
make -j"${JOBS:-8}" "$NCCL_BIN" "$PLAIN_BIN" GPU_COMPUTE_CAPABILITY="${GPU_COMPUTE_CAPABILITY-90}" CUDA_WERROR= >/dev/null || {
    echo "FAIL: build"; exit 1; }
if ! [[ "$(ldd "$NCCL_BIN" 2>/dev/null)" == *libnccl* ]]; then
    echo "SKIP: $NCCL_BIN has no NCCL ($(make -s cuda-info | grep multi-GPU))"
    exit 77
fi
[[ -f data/synthetic/synthetic_train.bin ]] || python3 dev/data/synthetic.py >/dev/null || { echo "FAIL: data"; exit 1; }

MPIRUN=()
if command -v mpirun >/dev/null; then
    MPIRUN=(mpirun -np 1 -x REMAT_NCCL_OVERLAP)
    [[ "$(id -u)" != 0 ]] || MPIRUN+=(--allow-run-as-root)
fi
export REMAT_NCCL_OVERLAP=1
if [[ -n "${LOGDIR:-}" ]]; then
    TMP=$LOGDIR/nccl_one_gpu
    rm -rf "$TMP" && mkdir -p "$TMP" || exit 1
else
    TMP=$(mktemp -d)
fi
# 4 layers x 256 channels, 2 micro-steps per step (gradient accumulation arms the hook on the second)
ARGS=(-e d6 --layers 4 --channels 256 --heads 4 --vocab-size 256 --max-seq-len 256 -b 8 -t 256 -d 4096
      -i data/synthetic/synthetic_train.bin -j data/synthetic/synthetic_val.bin -v 10 -m 4 -s 0 -l 1e-3 -k constant)
FAILED=0

run() { # name, command...
    local name=$1; shift
    if ! timeout 300 "$@" >"$TMP/$name.log" 2>&1; then
        grep -q '^error: no CUDA device' "$TMP/$name.log" && return 1
        echo "FAIL: $name exited non-zero:"; { grep -m 3 '^error' "$TMP/$name.log" || tail -n 5 "$TMP/$name.log"; }
        FAILED=1; return 1
    fi
    # step number, loss, norm (not time) and validation losses
    grep -E '^(step|val loss)' "$TMP/$name.log" | awk -F'|' '/^step/ {print $1 "|" $2 "|" $4; next} {print}' >"$TMP/$name.txt"
}
same() { # name, reference name, [first line to compare]
    if [[ ! -s "$TMP/$1.txt" ]]; then echo "FAIL: $1 printed no steps"; FAILED=1; return; fi
    if diff <(tail -n +"${3:-1}" "$TMP/$2.txt") <(tail -n +"${3:-1}" "$TMP/$1.txt") >"$TMP/$1.diff"; then
        echo "ok: $1 equals $2 ($(wc -l <"$TMP/$1.txt") lines)"
    else
        echo "FAIL: $1 differs from $2:"; head -n 8 "$TMP/$1.diff"; FAILED=1
    fi
}

run plain "$PLAIN_BIN" "${ARGS[@]}" -x 20
if grep -q '^error: no CUDA device' "$TMP/plain.log"; then echo "SKIP: no CUDA device"; rm -rf "$TMP"; exit 77; fi
run nccl "${MPIRUN[@]}" "$NCCL_BIN" "${ARGS[@]}" -x 20
if grep -q '^data parallel: 1 process, NCCL' "$TMP/nccl.log"; then echo "ok: NCCL path in use: $(grep '^data parallel' "$TMP/nccl.log")"
else echo "FAIL: no 'data parallel' line from the NCCL build"; FAILED=1; fi
same nccl plain
run nccl_singleton "$NCCL_BIN" "${ARGS[@]}" -x 20 # MPI singleton, no mpirun
same nccl_singleton plain
REMAT_NCCL_OVERLAP=0 run nccl_after_backward "${MPIRUN[@]}" "$NCCL_BIN" "${ARGS[@]}" -x 20
same nccl_after_backward plain
run zero1 "${MPIRUN[@]}" "$NCCL_BIN" "${ARGS[@]}" -x 20 -z 1
same zero1 plain
# ZeRO-1 checkpoint at step 10, then resume to 20: the resumed steps equal the uninterrupted run's
run zero1_first "${MPIRUN[@]}" "$NCCL_BIN" "${ARGS[@]}" -x 10 -z 1 -o "$TMP/ck"
run zero1_resumed "${MPIRUN[@]}" "$NCCL_BIN" "${ARGS[@]}" -x 20 -z 1 -o "$TMP/ck" -y 1
grep -E '^step' "$TMP/zero1.txt" | tail -n 10 >"$TMP/zero1_tail.txt"
grep -E '^step' "$TMP/zero1_resumed.txt" >"$TMP/zero1_resumed_steps.txt"
same zero1_resumed_steps zero1_tail
if [[ $FAILED == 0 ]]; then
    echo "PASS: the NCCL build with one rank matches the plain build"
    [[ -n "${LOGDIR:-}" ]] || rm -rf "$TMP"
else
    echo "FAILED (logs in $TMP)"
fi
exit $FAILED
