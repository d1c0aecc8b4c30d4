#!/usr/bin/env bash
# One call on a GPU machine: build, run every test (GPU tests included), compute-sanitizer passes over
# the CUDA kernel and copy-stream tests, then the benchmarks. Logs go to $OUT (or ./device-out) when set.
set -uo pipefail
source "$(dirname "$0")/stage_env.sh"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
} 2>&1 | tee "$out/device.txt"
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -3
HYTRAIN_TEST_BUILD_DIR=build/device bash tests/run_all.sh -rs 2>&1 | tee "$out/tests.log" | tail -15
timeout 300 compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q -x \
  tests/python/test_cuda_adam.py tests/python/test_grad_norm.py tests/python/test_copies.py \
  -k "found_inf or on_gpu or close_to_torch or accumulates or non_finite_detected_everywhere and 8-nan \
  or clip or both_ways or waits_for and not name_the_call" 2>&1 | tee "$out/memcheck.log" | tail -6
timeout 300 compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q -x \
  tests/python/test_hybrid_adam_cuda.py -k "pipeline_matches or errors_surface or without_model" \
  2>&1 | tee "$out/memcheck_pipeline.log" | tail -6
timeout 200 compute-sanitizer --tool racecheck python3 -m pytest -q -x \
  tests/python/test_cuda_adam.py tests/python/test_grad_norm.py \
  -k "found_inf or accumulates and 1] or reproducible" 2>&1 | tee "$out/racecheck.log" | tail -4
python3 bench/gpu_adam.py 2>&1 | tee "$out/gpu_adam.txt"
python3 bench/copies.py 2>&1 | tee "$out/copies.txt"
python3 bench/hybrid_step.py --trace "$out/hybrid_trace.json" 2>&1 | tee "$out/hybrid_step.txt"
if [ "${HYTRAIN_DEVICE_CPU_BENCH:-0}" = 1 ]; then
  cmake -S . -B build/bench -G Ninja -DHYTRAIN_BUILD_BENCH=ON -DHYTRAIN_BUILD_PYTHON=OFF >/dev/null
  cmake --build build/bench --parallel >/dev/null
  ./build/bench/bench/cpu_adam_bench --params $((256 << 20)) 2>&1 | tee "$out/cpu_adam_bench.txt"
  python3 bench/cpu_adam.py --params $((256 << 20)) 2>&1 | tee "$out/cpu_adam_py.txt"
fi
