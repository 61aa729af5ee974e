#!/usr/bin/env bash
# The peer comparison of docs/benchmarks.md, on 4,096-token contexts of two public-domain texts: kl (as summarize
# reads) and kl-reconstruct (as compress reads) against the strongest peers at 50/20/10/5 % kept; then needle
# retrieval at 20/10 % in 2,048-token haystacks (in 4,096-token ones the default model answers 1 of 8 planted facts
# even from the full cache). Raw results go to benchmarks/results/.
# Usage: benchmarks/peers.sh MOBY_DICK.txt HAMLET.md [WINDOWS] [HAYSTACKS]
set -euo pipefail
moby=$1; hamlet=$2; windows=${3:-2}; haystacks=${4:-10}
out=$(dirname "$0")/results
methods=kl,kl-reconstruct,kvgrad,kvzip,expected_attention,observed_attention
for pair in "moby:$moby" "hamlet:$hamlet"; do
  klevict bench "${pair#*:}" --methods $methods --budgets 50%,20%,10%,5% --windows "$windows" --context 4096 \
    --seed 0 --quiet --out "$out/peers-${pair%%:*}-4k.json" > /dev/null
done
klevict bench "$moby" --task needle --methods kl,kl-reconstruct --budgets 20%,10% --windows "$haystacks" --needles 4 \
  --context 2048 --seed 0 --quiet --out "$out/needle-moby-2k.json" > /dev/null
