#!/usr/bin/env bash
# GPU check, run from the repository root on a machine with a CUDA GPU (klevict is already importable there):
#
#   bash examples/gpu_check.sh tests                      # the unit tests, every tensor on the GPU
#   bash examples/gpu_check.sh real MODEL DOC OUTDIR [LONG_DOC]  # the real model end to end (DOC), then the
#                                                                 # bench, cost and perf tables (LONG_DOC)
#   bash examples/gpu_check.sh cost MODEL LONG_DOC OUTDIR        # kl and snapkv against the full read at 2k and 8k
#                                                                 # tokens (with a profile), and bench fidelity
#   bash examples/gpu_check.sh shapes LONG_DOC OUTDIR DTYPE FOLDER...  # the cost at 8k and 32k tokens of models
#                                                                 # built from each FOLDER's config with random weights
#
# Each step has its own time limit and the script goes on after a failure, so one run reports everything; it exits
# non-zero if any step failed. CI never runs this (it has no GPU).
set -u
export PYTHONUNBUFFERED=1 KLEVICT_CACHE_DIR=${KLEVICT_CACHE_DIR:-/tmp/klevict-cache}
py=${PYTHON:-python3}
dev=${DEVICE:-cuda}
failed=0
step() {  # step SECONDS COMMAND...: run it, say how long it took and whether it failed
    local limit=$1 start=$SECONDS; shift
    echo "== $*"
    timeout "$limit" "$@" || { echo "!! failed (rc $?): $*"; failed=1; }
    echo "== $((SECONDS - start)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

case "${1:-}" in
tests)
    KLEVICT_TEST_DEVICE=cuda step 300 $py -m pytest -q -p no:warnings -p no:cacheprovider -m "not integration" tests
    ;;
real)
    model=$2 doc=$3 out=$4 long=${5:-$3}
    k="$py -m klevict_cli"
    step 150 $k summarize "$doc" --model "$model" --device "$dev" --budget 5% --json --max-new-tokens 96 \
        >"$out/summary.json"
    head -c 600 "$out/summary.json"; echo
    step 60 $k compress "$doc" --model "$model" --device "$dev" --budget 5% -o /tmp/doc.kvc
    step 30 $k inspect /tmp/doc.kvc
    for device in "$dev" cpu; do  # the same file answers on either device
        step 45 $k ask /tmp/doc.kvc "Who is Ishmael?" --model "$model" --device $device --max-new-tokens 48 --json \
            >"$out/ask-$device.json"
        head -c 400 "$out/ask-$device.json"; echo
    done
    step 120 $py examples/cost.py "$long" --model "$model" --device "$dev" --methods kl,snapkv,caote \
        --budgets 20%,10%,5% --reps 2 --json "$out/cost-cuda.json"
    step 240 $k bench "$long" --model "$model" --device "$dev" --methods all --windows 8 --seed 0 \
        --out "$out/bench-cuda.json"
    step 120 $py examples/perf.py "$long" --model "$model" --device "$dev" --dtype bfloat16 --json "$out/perf-cuda.json"
    ;;
cost)
    model=$2 long=$3 out=$4
    step 150 $py examples/cost.py "$long" --model "$model" --device "$dev" --tokens 2048,8192 --methods kl,snapkv \
        --budgets 10% --places 2 --reps 2 --json "$out/cost-default.json" --profile "$out/profile-default.txt"
    step 100 $py -m klevict_cli bench "$long" --model "$model" --device "$dev" --methods kl,snapkv --budgets 10%,5% \
        --windows 2 --seed 0 --out "$out/bench-cuda.json"
    ;;
shapes)
    long=$2 out=$3 dtype=$4
    shift 4
    for folder in "$@"; do
        name=$(basename "$folder")
        step "${SHAPE_SECONDS:-100}" $py examples/cost.py "$long" --model "$folder" --random-weights --device "$dev" \
            --dtype "$dtype" --tokens 8192,32768 --methods kl,snapkv --budgets 10% --places 1 --reps 1 \
            --json "$out/cost-$name.json" ${PROFILE:+--profile "$out/profile-$name.txt"}
    done
    ;;
*)
    echo "usage: bash examples/gpu_check.sh tests | real MODEL DOC OUTDIR [LONG_DOC] | cost MODEL LONG_DOC OUTDIR" \
         "| shapes LONG_DOC OUTDIR DTYPE FOLDER..." >&2
    exit 2
    ;;
esac
exit $failed
