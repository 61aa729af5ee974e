#!/usr/bin/env bash
# The benchmark behind the README's quality table: every eviction method on Moby Dick (or the document given as $1)
# with the default model, 8 windows of 2048 context + 256 continuation tokens at 20/10/5/2 %; raw numbers go to
# bench-moby.json. Extra arguments are passed on (e.g. --device cuda, --context 4096, --task both).
# Set KLEVICT=... to use an installed klevict instead of setting up .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
DOC=${1:-../shared/data/moby-dick.txt}
shift || true
if [ -z "${KLEVICT:-}" ]; then
  bash examples/setup.sh
  . .venv/bin/activate
  KLEVICT=klevict
fi
"$KLEVICT" bench "$DOC" --methods all --budgets 20%,10%,5%,2% --windows 8 --seed 0 --out bench-moby.json "$@"
