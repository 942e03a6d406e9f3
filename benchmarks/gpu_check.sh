#!/usr/bin/env bash
# The GPU check: the CUDA-marked tests, then `specserve bench gpu` (an 8B-shape random model
# with an EAGLE-3 head and a 1B-shape draft, beside transformers), writing gpu.json and gpu.md
# to OUT_DIR (default runs/gpu). Needs only PyTorch and transformers beyond specserve's own
# dependencies; run from the repository root, within 8 minutes on one H100 or H200.
#   benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]
#   --dry-run: tiny shapes in float32 on the CPU (CI runs it so the command cannot rot)
set -euo pipefail
cd "$(dirname "$0")/.."
dry=""
if [ "${1:-}" = "--dry-run" ]; then dry="--dry-run"; shift; fi
out="${1:-runs/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# the random models are built where there is room in RAM if possible (16 GB for the 8B shape)
root="${SPECSERVE_GPU_MODELS:-runs/random}"
if [ -z "$dry" ] && [ -z "${SPECSERVE_GPU_MODELS:-}" ] \
    && [ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')" -gt 25000000 ] 2>/dev/null; then
  root=/dev/shm/specserve-random
fi
echo "== CUDA tests"
tests=0   # a failing test does not stop the benchmark; the script's status reports it
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda.py 2>&1 | tee "$out/gpu_tests.log" \
  || tests=$?
echo "== benchmark"
if [ -n "$dry" ]; then
  python3 -m specserve.cli bench gpu --dry-run --models-root "$root" --out "$out" \
    --batch-sizes 1,4 --max-tokens 16 --rounds 1
else
  python3 -m specserve.cli bench gpu --models-root "$root" --out "$out" --profile
fi
exit "$tests"
