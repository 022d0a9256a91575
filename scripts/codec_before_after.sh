#!/usr/bin/env bash
# The lossy codecs' speed per core before and after a change (bench/codec_ab.py): REV's codecs and
# this checkout's in one process, one 2 MiB block beside the other, best and median of ROUNDS each.
# Usage: bash scripts/codec_before_after.sh [REV (default 3fa6bdb: before the fp8/k8v4 encode work)] [ROUNDS] [DTYPE]
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:-3fa6bdb}"
rounds="${2:-400}"
dtype="${3:-bfloat16}"
py="${PYTHON:-.venv/bin/python}"
before="$(mktemp -d /tmp/kvstrata-codec-before-XXXXXX)"
trap 'git worktree remove --force "$before" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$before" "$rev" >/dev/null
"$py" -m bench.codec_ab --before "$before" --after . --rounds "$rounds" --blocks 1 --same-process --dtype "$dtype" \
    --out "docs/data/codecs_encode_ab_${dtype}.json"
