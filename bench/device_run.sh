#!/usr/bin/env bash
# One call on a GPU machine: build, run every test (GPU tests included), a compute-sanitizer pass over
# the CUDA AdamW tests, then the benchmarks. Logs go to $OUT (or ./device-out) when set.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
} 2>&1 | tee "$out/device.txt"
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -3
HYTRAIN_TEST_BUILD_DIR=build/device bash tests/run_all.sh -rs 2>&1 | tee "$out/tests.log" | tail -15
timeout 240 compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q -x \
  tests/python/test_cuda_adam.py -k "found_inf or on_gpu or close_to_torch" 2>&1 | tee "$out/memcheck.log" | tail -6
timeout 120 compute-sanitizer --tool racecheck python3 -m pytest -q -x \
  tests/python/test_cuda_adam.py -k "found_inf" 2>&1 | tee "$out/racecheck.log" | tail -4
python3 bench/gpu_adam.py 2>&1 | tee "$out/gpu_adam.txt"
if [ "${HYTRAIN_DEVICE_CPU_BENCH:-0}" = 1 ]; then
  cmake -S . -B build/bench -G Ninja -DHYTRAIN_BUILD_BENCH=ON -DHYTRAIN_BUILD_PYTHON=OFF >/dev/null
  cmake --build build/bench --parallel >/dev/null
  ./build/bench/bench/cpu_adam_bench --params $((256 << 20)) 2>&1 | tee "$out/cpu_adam_bench.txt"
  python3 bench/cpu_adam.py --params $((256 << 20)) 2>&1 | tee "$out/cpu_adam_py.txt"
fi
