#!/usr/bin/env bash
# The whole GPU check in one run that fits 9 minutes (530 s) on a borrowed H200
# (status of the code it checks: compiles, unverified on GPU until this runs).
# Stages in order of value, so that the first ones finish inside any budget:
#   1. build every CUDA target for sm_90 in BF16, FP32 and FP16 (make cuda-all),
#      then dev/ptxas_check.py (BF16, FP16): any register spill, or attention
#      registers above llmc/cuda/attention_mma.cuh's budgets (AttMmaRegs), fails loudly
#   2. the default kernels correct: test_gpt in each precision, BF16 first with
#      CUDA_LAUNCH_BLOCKING=1 (GPU against the CPU reference, bitwise
#      equality across -r settings, loss scaling, inf/NaN gradients)
#      (if BF16 fails: test_gpt bf16 again with ATTENTION=simt, to tell a
#      tensor-core attention fault from the rest); the Llama family's cases
#      (RMSNorm, RoPE, SwiGLU, grouped-query attention: the shapes test_gpt names
#      llama*/qwen2*) get a row of their own, from that log or from
#      $LLAMA_TEST_GPT when a flag runs them alone
#   3. throughput of d12 at T=1024 (random init, random GPT-2-vocabulary
#      tokens) with -r 0, -r 2 and -r 1: ms/step, tok/s, MFU, planned and
#      measured device memory, step-1 loss, and step 10's breakdown
#      (REMAT_PROFILE: forward, attention, recompute, ...), whose phases calibrate the time
#      model (REMAT_PROFILE_COST_MODEL: cost_model_d12.txt for --cost-model); the
#      smollm2-135m shape (Llama block: RMSNorm, RoPE, SwiGLU, 9 query heads on 3 K/V
#      heads of 64) the same way at -r 0 and -r 1, on random tokens of its 49,152-token
#      vocabulary (its calibrated rates: cost_model_smollm2.txt); then the d12 shape side by side in
#      PyTorch (dev/bench/torch_gpt2.py: our own minimal GPT-2 trainer, eager,
#      SDPA attention, fused AdamW, bf16 autocast), from the same init (remat's
#      draws from --seed) and the same first batch, so the step-1 losses agree
#      to bf16 precision (skipped when python3 has no torch)
#   4. compute-sanitizer (memcheck with the plan's NVTX regions, racecheck,
#      synccheck, initcheck) on test_gpt --sanitize: the smallest cases and the
#      default attention at head sizes 64 and 128, T=77, forward and backward,
#      with and without dropout
#   5. the attention kernels alone (dev/bench/bench_attention.cu: tensor cores
#      against CUDA cores at the d12 and 24x2048 shapes, ms and TFLOP/s; and
#      RoPE beside attention at llama3.1-8b's heads, T = 32768: the forward's
#      pass, and the backward's epilogue turn against a pass after it) and the
#      memory-bound kernels alone (dev/bench/bench_memory.cu: 16-byte vector
#      paths against scalar paths at GPT-2 124M shapes, ms and GB/s)
#   6. short training runs on the synthetic dataset in BF16 and FP16 (dynamic
#      loss scaling): final val loss against the dataset's entropy floor
#   7. dev/bench/sweep_recompute.py --quick (FP16): planned and measured memory
#      and ms/step of d12 and the 24 x 2048 model at T = 2048 to 8192
#   8. scripts/check_nccl_one_gpu.sh: the NCCL build with one rank against the
#      plain build (skipped with 77 when the machine has no NCCL or MPI)
#   9. with 2 or more GPUs only: NCCL data parallel, 2 ranks x B against one
#      rank x 2B, ZeRO-1 against ZeRO-0; context parallelism, 2 ranks sharing
#      each sequence (--context-parallel 2) against one rank; a row saying why
#      they did not run otherwise
# and prints a compact markdown table last (also written to out/gpu_check/summary.md),
# also when a stage or the script is killed (a trap prints what has finished).
# A failing or timed-out stage is recorded in the table; later stages still run.
# Stages 3 and 5-7 run the plain single-process builds (build/train_gpt_nompi_*), so
# NCCL and MPI setup can only affect stages 8 and 9.
#
# usage: dev/gpu_check.sh        (from anywhere; logs in out/gpu_check)
# With $OUT set (the borrowed machine's result folder, which returns only a
# few files), it receives exactly two: summary.md and gpu_check_logs.tgz
# (every stage's log, the sweep's table, csv and plot, the NCCL check's runs).
# env:   GPU_CHECK_BUDGET  seconds for everything (default 530)
#        JOBS              parallel make jobs (default 8)
#        D12_BATCH         -b of the throughput runs (default 16)
#        LLAMA_TEST_GPT    a command that runs test_gpt's Llama/Qwen2 cases alone (default empty:
#                          they run inside stage 2's test_gpt bf16, whose log gives their row)
set -u
cd "$(dirname "$0")/.." || exit 1
LOGDIR=out/gpu_check
rm -rf "$LOGDIR"
mkdir -p "$LOGDIR"
BUDGET=${GPU_CHECK_BUDGET:-530}
JOBS=${JOBS:-8}
D12_B=${D12_BATCH:-16}
LLAMA_TEST_GPT=${LLAMA_TEST_GPT:-}
T0=$(date +%s)
SUMMARY=()
THR=()
PROF=()

now() { date +%s; }
remaining() { echo $(( BUDGET - ($(now) - T0) )); }

# stage NAME LIMIT CMD...: runs CMD under timeout (capped by the time left),
# output in LOGDIR/NAME.log; returns CMD's status (124: timed out, 125: no time left).
stage() {
    local name=$1 limit=$2
    shift 2
    local left
    left=$(( $(remaining) - 15 ))
    if (( left < 10 )); then
        echo "== $name: skipped, no time left" | tee "$LOGDIR/$name.log"
        return 125
    fi
    (( limit > left )) && limit=$left
    echo "== $name (limit ${limit}s): $*"
    local start rc
    start=$(now)
    # in the background and waited for, so that a TERM or INT reaches the trap at once (bash defers traps
    # until a foreground child ends)
    timeout --kill-after=10 "$limit" "$@" > "$LOGDIR/$name.log" 2>&1 &
    STAGE_PID=$!
    STAGE_NAME=$name
    wait "$STAGE_PID"
    rc=$?
    STAGE_PID=
    echo "   rc=$rc after $(( $(now) - start ))s; last lines:"
    tail -n 4 "$LOGDIR/$name.log" | sed 's/^/   | /'
    return $rc
}

status_word() { # rc -> word
    case $1 in
        0) echo ok ;;
        124|137) echo "TIMEOUT" ;;
        125) echo "skipped (no time left)" ;;
        77) echo "SKIP (no GPU)" ;;
        *) echo "FAIL (rc $1)" ;;
    esac
}

echo "gpu_check: $(nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader 2>/dev/null | head -n 1)"

ATT_MD="$LOGDIR/bench_attention.md"
SWEEP_MD="$LOGDIR/sweep/sweep.md"
TORCH_NOTE=""

# ---- table: printed however the script ends (a stage killed, the outer limit, Ctrl-C) ----
print_summary() {
    [[ -n "${SUMMARY_PRINTED:-}" ]] && return
    SUMMARY_PRINTED=1
{
    echo
    echo "## GPU check ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), $(date -u +%Y-%m-%dT%H:%MZ), $(( $(now) - T0 ))s)"
    echo
    echo "| check | result |"
    echo "| --- | --- |"
    printf '%s\n' "${SUMMARY[@]}"
    echo
    echo "d12 (124M), B=$D12_B T=1024, bf16, random init (seed 1337, the same weights in both trainers) and tokens, 30 steps;"
    echo "the smollm2-135m rows: remat alone, the same B, T and steps, random tokens of its 49,152-token vocabulary"
    echo "(average excludes step 1); MFU: PaLM model FLOPs over 989 TFLOPS; measured MiB: device memory in use after step 1"
    echo "(cudaMemGetInfo, CUDA context included, in both trainers); less context: minus the CUDA context and cuBLASLt"
    echo "handle remat measured before its one allocation (what the plan should account for)"
    echo
    echo "| run | status | ms/step | tok/s | MFU | planned MiB | measured MiB | measured less context MiB | step-1 loss |"
    echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    printf '%s\n' "${THR[@]}"
    if [[ -s "$ATT_MD" ]]; then
        echo
        echo "attention kernels alone (dev/bench/bench_attention.cu, bf16, causal; FLOPs 2*B*NH*T^2*hs forward, 2.5x backward):"
        echo
        cat "$ATT_MD"
    fi
    [[ -n "$TORCH_NOTE" ]] && { echo; echo "$TORCH_NOTE"; }
    if (( ${#PROF[@]} )); then
        echo
        echo "where remat's step 10 went (REMAT_PROFILE, CUDA events on the stream, ms):"
        echo
        printf -- '- %s\n' "${PROF[@]}"
    fi
    if [[ -f "$SWEEP_MD" ]]; then
        echo
        cat "$SWEEP_MD"
    fi
} | tee "$LOGDIR/summary.md"

if [[ -n "${OUT:-}" ]]; then
    cp "$LOGDIR/summary.md" "$OUT/summary.md"
    tar czf "$OUT/gpu_check_logs.tgz" -C out gpu_check
fi
}

# The table is printed whatever ends the script: a TERM or INT (an outer time
# limit) prints it from what has finished, then exits.
STAGE_PID=
STAGE_NAME=
on_signal() {
    [[ -n "$STAGE_PID" ]] && kill -TERM "$STAGE_PID" 2>/dev/null
    SUMMARY+=("| the script, stopped by a signal${STAGE_PID:+ during stage $STAGE_NAME (log: $STAGE_NAME.log)} | INTERRUPTED; later stages not run |")
    print_summary
    exit 130
}
trap on_signal INT TERM
trap 'print_summary' EXIT

# ---- 1. build, then spills and registers (dev/ptxas_check.py) ----
stage build 300 make -j"$JOBS" cuda-all build/train_gpt_nompi_bf16 build/train_gpt_nompi_fp16 GPU_COMPUTE_CAPABILITY=90 CUDA_WERROR=
BUILD_RC=$?
SUMMARY+=("| build, sm_90, bf16 + fp32 + fp16 (make cuda-all + train_gpt_nompi_bf16/fp16) | $(status_word $BUILD_RC) |")

# ptxas -v of every kernel test_gpt instantiates (BF16 and FP16): any spill,
# or an mma attention kernel above its register budget (AttMmaRegs)
# (llmc/cuda/attention_mma.cuh), fails this stage loudly (its lines in the table).
for p in bf16 fp16; do
    P=$(echo "$p" | tr a-z A-Z)
    stage "ptxas_$p" 240 python3 dev/ptxas_check.py --define "ENABLE_$P"
    rc=$?
    word=$(status_word $rc)
    (( rc == 0 )) && word="PASS: no spills, attention registers as asserted"
    (( rc == 1 )) && word="FAIL: $(grep -m 3 '^ptxas_check: FAIL' "$LOGDIR/ptxas_$p.log" | cut -c 20-140 | tr '\n' ';')"
    SUMMARY+=("| ptxas -v -warn-spills, sm_90, $p (dev/ptxas_check.py) | $word |")
done

# ---- 2. the default kernels correct: test_gpt per precision ----
# test_gpt_result LABEL BINARY LOGNAME: runs it and adds its row to the table; returns its status
test_gpt_result() {
    local label=$1 bin=$2 name=$3 rc word worst
    # shellcheck disable=SC2086 # $bin may be "env VAR=1 binary"
    stage "$name" 150 $bin
    rc=$?
    word=$(status_word $rc)
    (( rc == 0 )) && word="PASS"
    (( rc == 1 )) && word="FAIL: $(grep -c '^FAIL' "$LOGDIR/$name.log") FAIL lines (see log)"
    worst=$(sed -n 's/.*, worst \(.*\) at \([0-9.einf+-]*\) of its tolerance.*/\2 of tolerance (\1)/p' \
        "$LOGDIR/$name.log" | sort -g | tail -n 1)
    SUMMARY+=("| $label | $word${worst:+; worst error after step 1: $worst} |")
    return $rc
}
BF16_RC=0
for p in bf16 fp32 fp16; do
    if [[ -x build/test_gpt_$p ]]; then
        if [[ $p == bf16 ]]; then
            # the first contact: every launch waits, so an error names the kernel that made it
            test_gpt_result "test_gpt $p (CUDA_LAUNCH_BLOCKING=1)" "env CUDA_LAUNCH_BLOCKING=1 build/test_gpt_$p" "test_gpt_$p"
            BF16_RC=$?
        else
            test_gpt_result "test_gpt $p" "build/test_gpt_$p" "test_gpt_$p"
        fi
    else
        SUMMARY+=("| test_gpt $p | not built |")
    fi
done
# Only when BF16 failed: the same test with the CUDA-core attention kernels
# (ATTENTION=simt), which tells a tensor-core attention fault from the rest.
if (( BF16_RC == 1 )); then
    stage build_simt 120 make -j"$JOBS" BUILD=build/simt ATTENTION=simt build/simt/test_gpt_bf16 GPU_COMPUTE_CAPABILITY=90 CUDA_WERROR=
    if [[ -x build/simt/test_gpt_bf16 ]]; then
        test_gpt_result "test_gpt bf16, ATTENTION=simt (run because bf16 failed)" build/simt/test_gpt_bf16 test_gpt_bf16_simt
    else
        SUMMARY+=("| test_gpt bf16, ATTENTION=simt | not built |")
    fi
fi
# The Llama family's cases: alone when $LLAMA_TEST_GPT names a command for them, else
# counted in the bf16 log (their check lines name a llama* or qwen2* shape or kernel)
if [[ -n "$LLAMA_TEST_GPT" ]]; then
    test_gpt_result "test_gpt Llama/Qwen2 cases ($LLAMA_TEST_GPT)" "$LLAMA_TEST_GPT" test_gpt_llama
elif [[ -s "$LOGDIR/test_gpt_bf16.log" ]]; then
    n=$(grep -ciE 'llama|qwen2|rmsnorm|swiglu|rope' "$LOGDIR/test_gpt_bf16.log")
    bad=$(grep -iE 'llama|qwen2|rmsnorm|swiglu|rope' "$LOGDIR/test_gpt_bf16.log" | grep -c 'FAIL')
    word="$n lines, $bad FAIL"
    (( n == 0 )) && word="no Llama/Qwen2 lines in test_gpt_bf16.log (this test_gpt has no such cases)"
    SUMMARY+=("| test_gpt bf16, Llama/Qwen2 cases (RMSNorm, RoPE, SwiGLU, GQA; in test_gpt_bf16.log) | $word |")
else
    SUMMARY+=("| test_gpt bf16, Llama/Qwen2 cases | not run (no test_gpt_bf16 log) |")
fi

# ---- 3. d12 throughput at T=1024 on random GPT-2-vocabulary tokens ----
RANDOM_PY='
import os, sys
import numpy as np
sys.path.insert(0, "dev/data")
import datafile as df
out = "data/random50257"
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
df.write_shard(out + "/random50257_train.bin", rng.integers(0, 50257, size=2_000_000))
df.write_shard(out + "/random50257_val.bin", rng.integers(0, 50257, size=100_000))
print("wrote", out)
out = "data/random49152"  # the vocabulary of SmolLM2
os.makedirs(out, exist_ok=True)
df.write_shard(out + "/random49152_train.bin", rng.integers(0, 49152, size=2_000_000))
print("wrote", out)
'
stage random_shards 60 python3 -c "$RANDOM_PY"
THR=()
PROF=()
# throughput_run NAME LABEL MODEL R SHARD LIMIT [COST_MODEL_FILE]: 30 steps of MODEL at B=$D12_B, T=1024, -r R
# on SHARD, step 10 profiled (and written as a calibrated cost model to COST_MODEL_FILE when given);
# adds its rows to THR and PROF
throughput_run() {
    local name=$1 label=$2 model=$3 r=$4 shard=$5 limit=$6 cm=${7:-}
    if [[ -x build/train_gpt_nompi_bf16 && -f $shard ]]; then
        stage "$name" "$limit" env REMAT_PROFILE=10 ${cm:+REMAT_PROFILE_COST_MODEL=$cm} build/train_gpt_nompi_bf16 -e "$model" \
            -b "$D12_B" -t 1024 -x 30 -r "$r" -i "$shard" -j "" -v 0 -s 0
        rc=$?
        log="$LOGDIR/$name.log"
        ms=$(grep '^average step time' "$log" | awk '{print $4}')
        toks=$( [[ -n "$ms" ]] && python3 -c "print('%.0f' % ($D12_B * 1024 / ($ms / 1000.0)))" || echo "?")
        mfu=$(grep '^step ' "$log" | tail -n 1 | grep -o 'MFU [^ |]*' | awk '{print $2}')
        plan=$(grep -E '^ +total +[0-9.]+ MiB' "$log" | head -n 1 | awk '{print $2}')
        meas=$(grep -E '^device memory after step [0-9]+:' "$log" | awk '{print $6}')
        # less the CUDA context and cuBLASLt handle the trainer measured before allocating (not in the plan)
        ctx=$(sed -n 's/^ *difference .* = CUDA context and other processes \([0-9.]*\) + cuBLASLt handle \([0-9.]*\) .*/\1 \2/p' "$log")
        arena=$( [[ -n "$meas" && -n "$ctx" && -n "$plan" ]] && python3 -c "import sys; m, a, b, p = map(float, sys.argv[1:]); print('%.1f (%.1f%% of plan)' % (m - a - b, 100 * (m - a - b) / p))" "$meas" $ctx "$plan" || echo "?")
        loss1=$(grep -E '^step +1/' "$log" | awk '{print $5}')
        THR+=("| $label | $(status_word $rc) | ${ms:-?} | ${toks:-?} | ${mfu:-?} | ${plan:-?} | ${meas:-?} | $arena | ${loss1:-?} |")
        prof=$(grep -m 1 '^profile of step' "$log" | sed 's/^profile of //')
        PROF+=("$label: ${prof:-no profile line (see $name.log)}")
        if [[ -n "$cm" ]]; then
            rates=$(grep -m 1 '^cost model: ' "$log" | sed -n 's/.*(\(matmul [^,]*, attention [^,]*, memory [^,]*\),.*/\1/p')
            PROF+=("$label: calibrated time model ${rates:-not written (see $name.log)}${rates:+, in $cm}")
        fi
    else
        THR+=("| $label | not run | | | | | | | |")
    fi
}
for r in 0 2 1; do
    cm=
    (( r == 0 )) && cm="$LOGDIR/cost_model_d12.txt"
    throughput_run "d12_r$r" "remat -r $r" d12 "$r" data/random50257/random50257_train.bin 150 $cm
done
# The Llama block beside GPT-2's: SmolLM2-135M's shape (30 layers of 576, GQA 9/3, SwiGLU 1536, tied head)
for r in 0 1; do
    cm=
    (( r == 0 )) && cm="$LOGDIR/cost_model_smollm2.txt"
    throughput_run "smollm2_r$r" "remat smollm2-135m -r $r" smollm2-135m "$r" data/random49152/random49152_train.bin 90 $cm
done
# The PyTorch baseline on the same shape, data and init (about 20-40 s: import,
# CUDA context, init on the GPU, 30 eager steps); exit 77 = no torch here.
TORCH_NOTE=""
if [[ -f data/random50257/random50257_train.bin ]]; then
    stage d12_torch 90 python3 dev/bench/torch_gpt2.py -e d12 -b "$D12_B" -t 1024 -x 30 \
        -i data/random50257/random50257_train.bin --device cuda
    rc=$?
    log="$LOGDIR/d12_torch.log"
    word=$(status_word $rc)
    (( rc == 77 )) && word="SKIP (no torch)"
    ms=$(grep '^average step time' "$log" | awk '{print $4}')
    toks=$( [[ -n "$ms" ]] && python3 -c "print('%.0f' % ($D12_B * 1024 / ($ms / 1000.0)))" || echo "?")
    mfu=$(grep '^step ' "$log" | tail -n 1 | grep -o 'MFU [^ |]*' | awk '{print $2}')
    meas=$(grep -E '^device memory after step [0-9]+:' "$log" | awk '{print $6}')
    loss1=$(grep -E '^step +1/' "$log" | awk '{print $5}')
    THR+=("| torch (eager, SDPA) | $word | ${ms:-?} | ${toks:-?} | ${mfu:-?} | - | ${meas:-?} | - | ${loss1:-?} |")
    TORCH_NOTE=$(python3 - "$log" <<'PY' 2>/dev/null
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("summary {"):
        s = json.loads(line[len("summary "):])
        print("torch: dev/bench/torch_gpt2.py, PyTorch %s, eager, SDPA, fused AdamW, bf16 autocast over fp32 weights; "
              "allocator peak %.0f MiB allocated, %.0f MiB reserved (without the CUDA context)"
              % (s["torch"], s.get("peak_allocated_mib") or 0, s.get("peak_reserved_mib") or 0))
PY
)
else
    THR+=("| torch (eager, SDPA) | not run (no random shard) | | | | | | | |")
fi

# ---- 4. compute-sanitizer on test_gpt --sanitize ----
# memcheck with the plan's buffers registered as NVTX regions (accesses between
# buffers of the one arena are errors), racecheck (shared memory hazards),
# synccheck (barriers), initcheck (reads of device memory never written), on
# test_gpt --sanitize: the smallest cases (--quick: head size 16) and the
# default attention (the inline-PTX mma kernels) at head sizes 64 and 128,
# T=77 (masked edge tiles), forward and backward, with and without dropout,
# alone and inside the model.
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
for tool in memcheck racecheck synccheck initcheck; do
    label="compute-sanitizer $tool, test_gpt bf16 --sanitize (hs 16, 64, 128; T=77; dropout 0 and 0.1)"
    if [[ -z "$SANITIZER" ]]; then
        SUMMARY+=("| $label | not run (no compute-sanitizer) |")
        continue
    fi
    if [[ ! -x build/test_gpt_bf16 ]]; then
        SUMMARY+=("| $label | not run (build/test_gpt_bf16 missing) |")
        continue
    fi
    extra=()
    [[ $tool == memcheck ]] && extra=(--nvtx yes --leak-check full)
    stage "sanitizer_$tool" 90 "$SANITIZER" --tool "$tool" "${extra[@]}" --error-exitcode 3 build/test_gpt_bf16 --sanitize
    rc=$?
    word=$(status_word $rc)
    (( rc == 3 )) && word="FAIL: $(grep -m 1 -E '^========= (Invalid|Race|Barrier|Uninitialized|Error)' "$LOGDIR/sanitizer_$tool.log" | cut -c 11-90)"
    errors=$(sed -n 's/^========= ERROR SUMMARY: \([0-9]*\) error.*/\1/p' "$LOGDIR/sanitizer_$tool.log" | tail -n 1)
    SUMMARY+=("| $label | $word${errors:+ ($errors errors)} |")
done

# ---- 5a. attention kernels alone: tensor cores against CUDA cores ----
ATT_MD="$LOGDIR/bench_attention.md"
rm -f "$ATT_MD"
if [[ -x build/bench_attention_bf16 ]]; then
    for shape in "16 1024 12 64" "4 8192 16 128" "1 131072 16 128"; do  # the launch report (runs nothing): grids, blocks per SM
        build/bench_attention_bf16 --launch $shape >> "$LOGDIR/attention_launch.log" 2>&1
    done
    stage bench_attention 120 build/bench_attention_bf16
    rc=$?
    grep '^|' "$LOGDIR/bench_attention.log" > "$ATT_MD"
    att_rate() { grep "^| 4 8192 16 128 | $1" "$ATT_MD" | awk -F'|' '{gsub(/ /, "", $5); gsub(/ /, "", $7); print "fwd " $5 ", bwd " $7}'; }
    big=$(att_rate mma) tcr=$(att_rate tc) ref=$(att_rate simt)
    SUMMARY+=("| attention alone, B=4 T=8192 NH=16 hs=128 (bf16), table below | $(status_word $rc)${big:+: mma $big TFLOP/s; tc $tcr; simt $ref} |")
    stage bench_attention_rope 60 build/bench_attention_bf16 --rope 1 32768 32 8 128
    rc=$?
    rope=$(grep -m 1 '^rope ' "$LOGDIR/bench_attention_rope.log" | sed -E 's/^rope B=1 T=32768 NH=32 NKV=8 hs=128 //')
    SUMMARY+=("| RoPE beside attention, llama3.1-8b heads, T=32768 (bf16; pass: forward's RoPE; bwd_fused: turned back in the epilogues; bwd_then_pass: the pass after instead) | $(status_word $rc)${rope:+: $rope} |")
else
    SUMMARY+=("| attention alone (bench_attention_bf16) | not built |")
fi

# ---- 5b. memory-bound kernels alone: 16-byte vector against scalar paths ----
if [[ -x build/bench_memory_bf16 ]]; then
    stage bench_memory 30 build/bench_memory_bf16
    rc=$?
    ln=$(grep '^| layernorm forward' "$LOGDIR/bench_memory.log" | awk -F'|' '{gsub(/ /, "", $5); gsub(/ /, "", $8); print $5 " GB/s, " $8 " the scalar path"}')
    SUMMARY+=("| memory-bound kernels alone (bench_memory_bf16; table in bench_memory.log) | $(status_word $rc)${ln:+: layernorm forward $ln} |")
else
    SUMMARY+=("| memory-bound kernels alone (bench_memory_bf16) | not built |")
fi

# ---- 6. synthetic dataset, short training run ----
stage synthetic_data 60 python3 dev/data/synthetic.py
FLOOR=$(python3 -c "import json; print('%.4f' % json.load(open('data/synthetic/synthetic_meta.json'))['entropy_nats_per_token'])" 2>/dev/null || echo "?")
for p in bf16 fp16; do
    label="synthetic, 4 layers x 256 ch, B=16 T=256, 300 steps ($p)"
    if [[ -x build/train_gpt_nompi_$p && -f data/synthetic/synthetic_train.bin ]]; then
        stage "train_synthetic_$p" 150 "build/train_gpt_nompi_$p" -e d6 --layers 4 --channels 256 --heads 4 --vocab-size 256 \
            --max-seq-len 256 -b 16 -t 256 -x 300 -l 1e-3 -u 20 -i data/synthetic/synthetic_train.bin \
            -j data/synthetic/synthetic_val.bin -v 100 -m 20 -s 0
        rc=$?
        log="$LOGDIR/train_synthetic_$p.log"
        VAL=$(grep '^val loss' "$log" | tail -n 1 | awk '{print $3}')
        MS=$(grep '^average step time' "$log" | awk '{print $4}')
        SKIPS=$(grep -c 'skipped: inf/NaN gradients' "$log")
        EXTRA=""
        [[ $p == fp16 ]] && EXTRA=", $SKIPS steps skipped by the loss scaler"
        if [[ -n "$VAL" && "$FLOOR" != "?" ]]; then
            GAP=$(python3 -c "print('%+.4f' % ($VAL - $FLOOR))")
            SUMMARY+=("| $label | $(status_word $rc): val loss $VAL vs floor $FLOOR ($GAP nats), ${MS:-?} ms/step$EXTRA |")
        else
            SUMMARY+=("| $label | $(status_word $rc): no val loss (floor $FLOOR)$EXTRA |")
        fi
    else
        SUMMARY+=("| $label | not run (binary or data missing) |")
    fi
done

# ---- 7. recompute sweep, quick subset (FP16) ----
# The sweep stops starting cells when its own budget runs out and still writes
# its table (skipped cells say why), so give it what is left, at most 150s.
SWEEP_MD="$LOGDIR/sweep/sweep.md"
rm -f "$SWEEP_MD"
if [[ -x build/train_gpt_nompi_fp16 ]]; then
    # at most 110 s, so that the NCCL check after it keeps about a minute
    SWEEP_S=$(( $(remaining) - 70 ))
    (( SWEEP_S > 110 )) && SWEEP_S=110
    if (( SWEEP_S >= 40 )); then
        stage sweep_quick $(( SWEEP_S + 10 )) python3 dev/bench/sweep_recompute.py --quick --exe build/train_gpt_nompi_fp16 --budget-s "$SWEEP_S" --out "$LOGDIR/sweep"
        rc=$?
        key=$(python3 - "$LOGDIR/sweep/sweep.csv" <<'PY' 2>/dev/null
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    if r["model"] == "24x2048" and r["T"] == "8192" and r["recompute"] == "1":
        meas = "%.1f GiB" % (float(r["measured_mib"]) / 1024) if r["measured_mib"] else "-"
        print("24x2048 T=8192 -r 1: plan %s GiB, measured %s (%s of plan without the CUDA context), %s ms/step (%s)"
              % (r["planned_gib"], meas, r["arena_over_plan"] or "-", r["ms_per_step"] or "-", r["status"]))
PY
)
        SUMMARY+=("| recompute sweep --quick (fp16), table below | $(status_word $rc)${key:+: $key} |")
    else
        SUMMARY+=("| recompute sweep --quick (fp16) | skipped (no time left) |")
    fi
else
    SUMMARY+=("| recompute sweep --quick (fp16) | not run (build/train_gpt_nompi_fp16 missing) |")
fi

# ---- 8. the NCCL path with one rank gives the plain build's losses ----
stage nccl_one_gpu 120 env LOGDIR="$LOGDIR" scripts/check_nccl_one_gpu.sh
rc=$?
word=$(status_word $rc)
(( rc == 77 )) && word="$(grep -m 1 '^SKIP' "$LOGDIR/nccl_one_gpu.log")"
SUMMARY+=("| NCCL build, 1 rank vs plain build: equal losses/norms/val, -z 0/1, overlap on/off, -z 1 resume | $word |")

# ---- 9. several GPUs: NCCL data parallel, 2 ranks x B against 1 rank x 2B ----
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
label="NCCL data parallel, 2 GPUs: 2 ranks x B=8 vs 1 rank x B=16, d6 4x256 synthetic, 20 steps (bf16), -z 0 and -z 1"
if (( NGPU < 2 )); then
    SUMMARY+=("| $label | not run ($NGPU GPU on this machine) |")
elif [[ ! -x build/train_gpt_bf16 ]] || ! command -v mpirun >/dev/null || [[ ! -f data/synthetic/synthetic_train.bin ]]; then
    SUMMARY+=("| $label | not run (build/train_gpt_bf16 with NCCL, mpirun or the synthetic data missing) |")
else
    MP=(mpirun -np 2)
    [[ "$(id -u)" != 0 ]] || MP+=(--allow-run-as-root)
    DP_ARGS=(-e d6 --layers 4 --channels 256 --heads 4 --vocab-size 256 --max-seq-len 256 -t 256 -x 20 -l 1e-3
             -i data/synthetic/synthetic_train.bin -j "" -s 0)
    stage dp_one 90 build/train_gpt_bf16 "${DP_ARGS[@]}" -b 16
    stage dp_two_z0 90 "${MP[@]}" build/train_gpt_bf16 "${DP_ARGS[@]}" -b 8 -z 0
    rc0=$?
    stage dp_two_z1 90 "${MP[@]}" build/train_gpt_bf16 "${DP_ARGS[@]}" -b 8 -z 1
    rc1=$?
    # the same bound as the emulated test (dev/test/test_emu_multigpu.py): bf16 losses within 2e-3 of one rank's
    # after 4 steps; 20 steps here, so the worst difference is reported, and ZeRO-1 must equal ZeRO-0 bitwise
    cmp=$(python3 - "$LOGDIR/dp_one.log" "$LOGDIR/dp_two_z0.log" "$LOGDIR/dp_two_z1.log" <<'PY' 2>&1
import re, sys
rx = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr \S+ \| norm ([0-9.]+)", re.M)
one, z0, z1 = (rx.findall(open(f).read()) for f in sys.argv[1:4])
if not one or len(one) != len(z0):
    print("step lines missing"); sys.exit(1)
worst = max(abs(float(a[1]) - float(b[1])) for a, b in zip(one, z0))
print("worst |loss 2x8 - loss 1x16| %.2e over %d steps; ZeRO-1 %s ZeRO-0" % (worst, len(one), "==" if z1 == z0 else "!="))
sys.exit(0 if z1 == z0 and worst < 5e-2 else 1)
PY
)
    crc=$?
    word=$(status_word $(( rc0 | rc1 | crc )))
    (( rc0 == 0 && rc1 == 0 && crc == 0 )) && word="PASS"
    SUMMARY+=("| $label | $word: $cmp |")
    # context parallelism: the ring over NCCL against one rank holding the whole sequences (same tokens per step)
    stage cp_one 90 build/train_gpt_bf16 "${DP_ARGS[@]}" -b 8
    stage cp_two 90 "${MP[@]}" build/train_gpt_bf16 "${DP_ARGS[@]}" -b 8 --context-parallel 2
    rc2=$?
    cmp=$(python3 - "$LOGDIR/cp_one.log" "$LOGDIR/cp_two.log" <<'PY' 2>&1
import re, sys
rx = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| lr \S+ \| norm ([0-9.]+)", re.M)
one, two = (rx.findall(open(f).read()) for f in sys.argv[1:3])
if not one or len(one) != len(two):
    print("step lines missing"); sys.exit(1)
worst = max(abs(float(a[1]) - float(b[1])) for a, b in zip(one, two))
print("worst |loss ring of 2 - loss 1 rank| %.2e over %d steps" % (worst, len(one)))
sys.exit(0 if worst < 5e-2 else 1)
PY
)
    crc=$?
    word=$(status_word $(( rc2 | crc )))
    (( rc2 == 0 && crc == 0 )) && word="PASS"
    SUMMARY+=("| NCCL context parallel, 2 GPUs: --context-parallel 2 (B=8, T=256) vs 1 rank, d6 4x256 synthetic, 20 steps (bf16) | $word: $cmp |")
fi

print_summary
