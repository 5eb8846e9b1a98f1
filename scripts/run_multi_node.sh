#!/usr/bin/env bash
# Data-parallel training over several machines with OpenMPI and a host file:
# one train_gpt process per GPU on every node. Status: compiles, unverified on
# GPU.
#
# Usage: HOSTFILE=hosts GPUS_PER_NODE=8 scripts/run_multi_node.sh [train_gpt flags]
#
# The host file lists one node per line with its GPU count as slots:
#     node01 slots=8
#     node02 slots=8
# Requirements: passwordless ssh from this node to the others; the same
# directory (this repository, built, the data and the -o output directory) at
# the same path on every node, best a shared file system: rank 0 writes the
# model file, every rank its own state file, and resuming needs them all.
#
# Environment (every NCCL_* variable set here is passed on to all ranks with
# mpirun -x; on remote nodes nothing else is inherited):
#   NCCL_SOCKET_IFNAME   IP interface for NCCL's bootstrap and socket transport,
#                        e.g. eth0, =ens1f0 (exactly), ^docker,lo (exclude).
#                        Set it when nodes have several interfaces and NCCL
#                        picks one the others cannot reach (a hang at start).
#   NCCL_IB_HCA          InfiniBand/RoCE adapters to use, e.g. mlx5_0,mlx5_1
#                        (NCCL_DEBUG=INFO lists what it found).
#   NCCL_IB_DISABLE=1    TCP sockets instead of InfiniBand (no IB, or to rule
#                        it out while debugging; much slower).
#   NCCL_DEBUG=INFO      print NCCL's choices at start (WARN by default here).
#   MPI_IFACE            interface for MPI's own traffic (small: start-up and
#                        host-side sums), e.g. eth0; default: OpenMPI's choice.
set -euo pipefail
cd "$(dirname "$0")/.."

HOSTFILE=${HOSTFILE:-hostfile}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAINER=${TRAINER:-./train_gpt}
[[ -f "$HOSTFILE" ]] || { echo "host file $HOSTFILE not found (set HOSTFILE)" >&2; exit 1; }
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || { echo "GPUS_PER_NODE '$GPUS_PER_NODE' is not a positive integer" >&2; exit 1; }
NODES=$(grep -cvE '^[[:space:]]*(#|$)' "$HOSTFILE" || true)
[[ "$NODES" -ge 1 ]] || { echo "host file $HOSTFILE lists no node (one 'name slots=N' line per node)" >&2; exit 1; }
NP=$((NODES * GPUS_PER_NODE))
[[ -x "$TRAINER" ]] || { echo "TRAINER '$TRAINER' is not an executable (make train_gpt builds ./train_gpt)" >&2; exit 1; }
if ! [[ "$(ldd "$TRAINER" 2>/dev/null)" == *libnccl* ]]; then
    echo "$TRAINER was built without NCCL and MPI: see 'make cuda-info'" >&2
    exit 1
fi

# d12 on FineWeb (python3 dev/data/fineweb.py), 16 x 1024 tokens per GPU per step
DEFAULT_ARGS=(-i "data/fineweb10B/fineweb_train_*.bin" -j "data/fineweb10B/fineweb_val_*.bin" -e d12 -b 16 -t 1024 -z 1 -l 6e-4 -u 700 -q 0.1 -c 0.1 -v 250 -s 1000 -o out/d12_multi_node)
[[ $# -gt 0 ]] || set -- "${DEFAULT_ARGS[@]}"

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
MPI_ARGS=(-np "$NP" --hostfile "$HOSTFILE" --map-by "ppr:${GPUS_PER_NODE}:node" --bind-to none -wdir "$PWD")
for v in $(compgen -e | grep -E '^(NCCL_|REMAT_|CUDA_VISIBLE_DEVICES$|LD_LIBRARY_PATH$|PATH$)'); do MPI_ARGS+=(-x "$v"); done
[[ -z "${MPI_IFACE:-}" ]] || MPI_ARGS+=(--mca btl_tcp_if_include "$MPI_IFACE" --mca oob_tcp_if_include "$MPI_IFACE")
[[ "$(id -u)" != 0 ]] || MPI_ARGS+=(--allow-run-as-root)
echo "mpirun ${MPI_ARGS[*]} $TRAINER $*"
exec mpirun "${MPI_ARGS[@]}" "$TRAINER" "$@"
