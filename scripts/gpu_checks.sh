#!/usr/bin/env bash
# The CUDA checks of docs/performance.md and docs/offload.md, on a machine with one NVIDIA GPU
# and a Python that has a CUDA build of torch plus kvstrata's dependencies (lmdb, msgpack,
# xxhash, pytest, hypothesis, matplotlib, tqdm). Run from the repository root:
#
#   bash scripts/gpu_checks.sh tests     # gpu-marked tests, then the whole suite, pool on CUDA
#   bash scripts/gpu_checks.sh benches   # bench transfer, bench demotion
#   bash scripts/gpu_checks.sh offload [LENGTHS]   # 32-layer Llama-3-8B shape, bf16
#
# Results (JSON, PNG) go to $KVSTRATA_BENCH_RESULTS (default results/).
set -uo pipefail
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd) PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
case "${1:-tests}" in
tests)
    "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs
    KVSTRATA_TEST_POOL_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -m "not vllm" -rs "${@:2}"
    ;;
benches)
    "$PY" -m cli.main bench transfer --mib 256 --repeat 5
    "$PY" -m cli.main bench demotion --requests 400 --layers 32
    ;;
offload)
    "$PY" -m cli.main offload --layers 32 --dtype bfloat16 --docs 1 --questions 3 \
        --lengths "${2:-8192,32768,131072}" --workdir "${KVSTRATA_BENCH_WORKDIR:-/tmp}"
    ;;
*)
    echo "usage: $0 tests|benches|offload [LENGTHS]" >&2
    exit 2
    ;;
esac
