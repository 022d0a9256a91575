#!/bin/bash
# The disk tier with LMDB's writemap (the environment's pages written in place in the map,
# no copy and write-out at commit) against the tier as it is: `bench scale-disk` at 10^5
# and 10^6 tiny blocks, one process per run, interleaved base wm wm base. Not adopted (see
# docs/performance.md, "The disk tier to 10^7 blocks"): this measures what it would buy.
# Usage: bash scripts/writemap_ab.sh [PYTHON]   (from the repository root)
set -eu
PY=${1:-$PWD/.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
for v in base wm; do
  mkdir -p "$WORK/$v"
  git archive HEAD | tar -x -C "$WORK/$v"
done
sed -i 's/meminit=False, lock=True,/meminit=False, lock=True, writemap=True,/' "$WORK/wm/tiers/disk/env.py"
grep -q writemap=True "$WORK/wm/tiers/disk/env.py"
for v in base wm wm base; do
  echo "=== $v $(date +%T)"
  mkdir -p "$WORK/run"
  (cd "$WORK/$v" && PYTHONPATH="$WORK/$v" nice -n 5 "$PY" -c \
    'import sys; from cli.main import main; sys.argv=["kvstrata"]+sys.argv[1:]; main()' \
    bench scale-disk --blocks 100000 --blocks 1000000 --payload-blocks 0 --dir "$WORK/run" | grep "tiny/")
  rm -rf "$WORK/run"
done
