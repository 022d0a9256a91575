#!/usr/bin/env bash
# The lossy codecs' speed per core before and after a change, alternating processes (bench/codec_ab.py).
# Usage: bash scripts/codec_before_after.sh [REV (default 3fa6bdb: before the fp8/k8v4 encode work)] [ROUNDS] [DTYPE]
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:-3fa6bdb}"
rounds="${2:-40}"
dtype="${3:-bfloat16}"
py="${PYTHON:-.venv/bin/python}"
before="$(mktemp -d /tmp/kvstrata-codec-before-XXXXXX)"
trap 'git worktree remove --force "$before" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$before" "$rev" >/dev/null
"$py" -m bench.codec_ab --before "$before" --after . --rounds "$rounds" --dtype "$dtype" \
    --out "docs/data/codecs_encode_ab_${dtype}.json"
