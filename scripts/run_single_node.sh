#!/usr/bin/env bash
# Data-parallel training on the GPUs of one machine: one train_gpt process per
# GPU, started by OpenMPI's mpirun. MPI only starts the processes and hands
# out the NCCL id; gradients and parameters travel over NCCL (NVLink or PCIe).
# Status: see the status table in README.md; docs/multi_process.md has the
# details.
#
# Usage: scripts/run_single_node.sh [train_gpt flags]
#   NGPUS=8 scripts/run_single_node.sh -e d12 -b 16 -t 1024 -z 1 -o out/d12
# Without flags it trains d12 on FineWeb with ZeRO-1 (see DEFAULT_ARGS).
#
# Environment:
#   NGPUS        processes = GPUs to use (default: every GPU nvidia-smi lists).
#                Rank r drives CUDA device r among the visible ones, so
#                CUDA_VISIBLE_DEVICES=4,5,6,7 NGPUS=4 uses the last four.
#   TRAINER      the binary (default ./train_gpt, built by `make train_gpt`;
#                it must be an NCCL build: `make cuda-info` says so).
#   NCCL_DEBUG   WARN by default here; INFO prints NCCL's version, the
#                transports it chose (P2P/NVLink, SHM, NET) and its rings and
#                trees at start: the first thing to look at when a run is slow
#                or hangs.
#   NCCL_P2P_DISABLE=1   no direct GPU-to-GPU copies (through host memory
#                instead): a workaround when P2P hangs or corrupts data on some
#                PCIe or virtualized machines (IOMMU, ACS); slower.
#   REMAT_NCCL_OVERLAP=0 reduce the gradients after the backward instead of
#                layer by layer during it (for comparison and debugging).
set -euo pipefail
cd "$(dirname "$0")/.."

TRAINER=${TRAINER:-./train_gpt}
NGPUS=${NGPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
if [[ -n "$NGPUS" && ! "$NGPUS" =~ ^[0-9]+$ ]]; then
    echo "run_single_node: NGPUS '$NGPUS' is not a number of GPUs" >&2
    exit 1
fi
if [[ -z "$NGPUS" || "$NGPUS" -lt 1 ]]; then
    echo "run_single_node: no GPU found by nvidia-smi; set NGPUS" >&2
    exit 1
fi
[[ -x "$TRAINER" ]] || make train_gpt
if ! [[ "$(ldd "$TRAINER" 2>/dev/null)" == *libnccl* ]]; then
    echo "$TRAINER was built without NCCL and MPI: see 'make cuda-info', then 'make clean train_gpt'" >&2
    exit 1
fi

# d12 (GPT-2 124M) on FineWeb (python3 dev/data/fineweb.py), one epoch of its
# 10B tokens at 2^19 tokens per step whatever NGPUS is (a power of 2 up to 32).
DEFAULT_ARGS=(-i "data/fineweb10B/fineweb_train_*.bin" -j "data/fineweb10B/fineweb_val_*.bin" -e d12 -b 16 -t 1024 -d 524288 -z 1 -l 6e-4 -u 700 -q 0.1 -c 0.1 -v 250 -s 1000 -o out/d12_single_node)
[[ $# -gt 0 ]] || set -- "${DEFAULT_ARGS[@]}"

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
MPI_ARGS=(-np "$NGPUS" --bind-to none) # GPU-bound work: no core pinning (try --bind-to numa on big hosts)
[[ "$(id -u)" != 0 ]] || MPI_ARGS+=(--allow-run-as-root) # containers often run as root; mpirun refuses that by default
echo "mpirun ${MPI_ARGS[*]} $TRAINER $*"
exec mpirun "${MPI_ARGS[@]}" "$TRAINER" "$@"
