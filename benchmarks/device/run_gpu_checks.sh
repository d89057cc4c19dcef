#!/usr/bin/env bash
# Run ON THE GPU DEVICE MACHINE, from the repository root: the CUDA tests and benchmarks/gpu.py, logs to $OUT.
#
# Needs .whl/ carried (benchmarks/device/prepare_carry.sh, run here first); the machine has torch with CUDA
# but no Ray and no network. One device call (10 minutes at most) per part, e.g. through the device tool:
#     run(command="bash benchmarks/device/run_gpu_checks.sh tests", carry=[".whl"], timeout_s=600)
#     run(command="bash benchmarks/device/run_gpu_checks.sh bench", carry=[".whl"], timeout_s=600)
# Parts: env (versions and nvidia-smi only), tests, bench, all (default: env + tests + bench; over 10 minutes).
# TESTS overrides which tests run (default: every test marked for CUDA in the files below); GPU_ARGS adds
# options to gpu.py; TEST_TIMEOUT and BENCH_TIMEOUT (seconds) bound each part so that the logs come back
# before the call's limit.
set -uo pipefail

PART="${1:-all}"
OUT="${OUT:-/tmp/raysgd-gpu-checks}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0

ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run benchmarks/device/prepare_carry.sh here and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing the carried wheels failed" >&2; exit 2; }
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, ray, raysgd; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "ray", ray.__version__, "raysgd", raysgd.__file__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'
} 2>&1 | tee "$OUT/env.txt"
status=${PIPESTATUS[0]}

if [ "$PART" = tests ] || [ "$PART" = all ]; then
  # -m cuda: the tests that need a GPU (they skip without one, so CI never runs them).
  TESTS="${TESTS:-tests/cluster/execution/test_cuda.py tests/unit/operator/test_sync.py tests/cluster/operator/test_precision.py}"
  # -v: a result line per test as it ends, so a run cut short by TEST_TIMEOUT still shows what passed
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -v -rA -m cuda -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.log"
  status=$((status | PIPESTATUS[0]))
fi

if [ "$PART" = bench ] || [ "$PART" = all ]; then
  # GPU_ARGS narrows the run (e.g. "--workloads resnet50" in a second call); gpu.py prints each finished
  # (workload, precision) and rewrites gpu.json as it goes, so a run cut short keeps what it measured.
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/gpu.py --threads 8 --json "$OUT/gpu.json" ${GPU_ARGS:-} 2>&1 \
    | tee "$OUT/gpu.log"
  status=$((status | PIPESTATUS[0]))
fi
exit "$status"
