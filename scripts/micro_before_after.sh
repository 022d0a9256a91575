#!/usr/bin/env bash
# `bench micro` before and after a change, interleaved, as ratios (bench/micro_ab.py).
# Usage: bash scripts/micro_before_after.sh [REV (default f686e78: before the #21 redesign)] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:-f686e78}"
rounds="${2:-4}"
before="$(mktemp -d /tmp/kvstrata-before-XXXXXX)"
trap 'git worktree remove --force "$before" >/dev/null 2>&1 || true' EXIT
git worktree add --detach "$before" "$rev" >/dev/null
.venv/bin/python -m bench.micro_ab --before "$before" --after . --rounds "$rounds"
