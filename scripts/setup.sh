#!/usr/bin/env bash
# Create .venv (idempotent) with the CPU build of torch and kvstrata in editable mode.
# Users with a CUDA build of torch can skip this and `pip install -e '.[dev]'` into their env.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first: the CPU build (a range in pyproject.toml would otherwise pull a CUDA build).
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import kvstore, lmdb, torch; print('kvstrata', kvstore.__version__, 'torch', torch.__version__)"
