#!/usr/bin/env bash
# The quick start's main job: prepare the embedded default dataset (synthetic
# Markov text with a known entropy floor), build, and train a small model on
# it: on the GPU with train_gpt when one is present, else with the CPU
# reference train_gpt_cpu. Ends by comparing the validation loss with the
# floor. Usage: scripts/quickstart.sh [extra trainer flags]
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -c "import numpy" 2>/dev/null || python3 -m pip install -q -r dev/data/requirements.txt
[ -f data/synthetic/synthetic_meta.json ] || python3 dev/data/synthetic.py
vocab=$(python3 -c "import json; print(json.load(open('data/synthetic/synthetic_meta.json'))['vocab_size'])")
floor=$(python3 -c "import json; print('%.4f' % json.load(open('data/synthetic/synthetic_meta.json'))['entropy_nats_per_token'])")
data=(-i data/synthetic/synthetic_train.bin -j data/synthetic/synthetic_val.bin --vocab-size "$vocab")

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && command -v nvcc >/dev/null 2>&1; then
    make train_gpt
    trainer=./train_gpt
    model=(-e d6 --layers 4 --channels 256 --heads 4 --max-seq-len 256 -b 16 -t 256 -x 600 -l 1e-3 -u 30 -q 0.1)
else
    echo "no GPU found: training with the CPU reference (train_gpt_cpu)"
    make train_gpt_cpu
    trainer=./train_gpt_cpu
    model=(-e d6 --layers 2 --channels 64 --heads 4 --max-seq-len 64 -b 16 -t 64 -x 500 -l 4e-3 -u 20 -q 0.05)
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$trainer" "${model[@]}" "${data[@]}" -v 100 -m 20 -s 250 -g 48 "$@" | tee "$log"
val=$(grep -oE "^val loss [^ ]+" "$log" | tail -1 | cut -d' ' -f3 || true)
echo
if [ -n "$val" ]; then
    echo "final validation loss $val nats/token; the data's entropy floor is $floor (a perfect model's loss)"
else
    echo "no validation loss to compare with the data's entropy floor ($floor nats/token): the run did not validate (-v 0 or -j \"\")"
fi
