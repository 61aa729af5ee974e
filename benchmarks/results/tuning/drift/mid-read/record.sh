#!/usr/bin/env bash
# Windows of 1,024 tokens and their first 512, read at 20 / 10 / 5 % with the drift estimate, on the same offsets
# (seed 5, 8 per text). Usage: record.sh MOBY_DICK.txt HAMLET.md [--model gemma3-270m] ; NAME=smol|gemma
set -euo pipefail
here=$(dirname "$0"); moby=$1; hamlet=$2; shift 2
export SPAN=1256 OMP_NUM_THREADS=1
for text in "$moby" "$hamlet"; do
  t=$(basename "$text" | cut -c1-4)
  for ctx in 512 1024; do
    python "$here/same_windows.py" bench "$text" "$@" --methods kl --budgets 20%,10%,5% --windows 8 --context $ctx \
      --seed 5 --estimate --out "$here/$NAME-$t-$ctx.json" --quiet > /dev/null
  done
done
