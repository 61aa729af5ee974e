#!/usr/bin/env bash
# The size-quality frontier of stored caches: kl's reading of 4,096-token windows of two public-domain texts at
# 50/30/17/10/5 % kept, each cache measured as `compress --cache-dtype` stores it (float32, float16, int8, int4) and
# `ask` loads it back: KL to the full cache on the 256 tokens that follow, and the bytes of its keys and values.
# Equal bytes: 5 % of the float32 cache's bytes is float16 at 10 % kept, int8 at 17 % and int4 at 30 % (int8 and int4
# spend 1/8 of a byte per element on steps and minima, and each head keeps its first entry in float16).
# Then, on the same windows, `compress --max-bytes` at 3/5/10 % of the float32 cache's bytes: the dtype it chooses,
# and the KL of the cache as stored (beside float32 at 10 % kept, the reference at 10 % of the bytes).
# Usage: [WINDOWS=N] [TEXTS=moby,hamlet] [PARTS=frontier,bytes] benchmarks/quantized.sh MOBY_DICK.txt HAMLET.md
set -euo pipefail
moby=$1; hamlet=$2; texts=,${TEXTS:-moby,hamlet},; parts=,${PARTS:-frontier,bytes},
here=$(dirname "$0"); out=$here/results
for pair in "moby:$moby" "hamlet:$hamlet"; do
  name=${pair%%:*}; text=${pair#*:}
  [[ $texts == *,$name,* ]] || continue
  common=(--methods kl --windows "${WINDOWS:-4}" --context 4096 --seed 1 --quiet --resume)
  if [[ $parts == *,frontier,* ]]; then
    klevict bench "$text" "${common[@]}" --budgets 50%,30%,17%,10%,5% --cache-dtype float32,float16,int8,int4 \
      --out "$out/quantized-$name-4096.json" > /dev/null
  fi
  if [[ $parts == *,bytes,* ]]; then
    klevict bench "$text" "${common[@]}" --budgets 10% --max-bytes 3%,5%,10% \
      --out "$out/quantized-bytes-$name-4096.json" > /dev/null
  fi
done
