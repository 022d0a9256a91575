#!/usr/bin/env bash
# Create .venv-dynamo (idempotent): NVIDIA Dynamo's runtime wheel (CPU-only, ~75 MB), whose
# standalone KV indexer (`python -m dynamo.indexer`) tests/router/test_dynamo.py subscribes to
# kvstrata stores, as the third-party reader of kvstrata's KV events (docs/routing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-dynamo/bin/python ]; then
    "$PY" -m venv .venv-dynamo
fi
if ! .venv-dynamo/bin/python -c "import dynamo.indexer" 2>/dev/null; then
    .venv-dynamo/bin/pip install -q ai-dynamo-runtime 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv-dynamo/bin/python -c "import importlib.metadata as m; print('ai-dynamo-runtime', m.version('ai-dynamo-runtime'))"
