#!/usr/bin/env bash
# Builds and runs the C++ tests (ctest) and the Python tests (pytest) against the installed package.
# GPU tests are skipped where no GPU is usable.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${HYTRAIN_TEST_BUILD_DIR:-build/tests}
cmake -S . -B "$build" -G Ninja -DHYTRAIN_BUILD_TESTS=ON -DHYTRAIN_BUILD_PYTHON=OFF ${HYTRAIN_CMAKE_ARGS:-}
cmake --build "$build" --parallel
ctest --test-dir "$build" --output-on-failure
# The lock-free queue and the update engine again, under ThreadSanitizer.
cmake -S . -B "$build-tsan" -G Ninja -DHYTRAIN_BUILD_TESTS=ON -DHYTRAIN_BUILD_PYTHON=OFF \
  -DHYTRAIN_ENABLE_CUDA=OFF -DHYTRAIN_SANITIZE=thread >/dev/null
cmake --build "$build-tsan" --parallel --target test_queue test_update_engine test_offload_pipeline test_param_table
ctest --test-dir "$build-tsan" -R "test_queue|test_update_engine|test_offload_pipeline|test_param_table" --output-on-failure
# Two test processes where no GPU is usable, each test file whole in one of them (its module fixtures
# run once); one where a GPU is, whose tests would share its memory.
parallel=()
if python3 -c "import sys, torch, xdist; sys.exit(torch.cuda.is_available())" 2>/dev/null; then
  parallel=(-n "${HYTRAIN_TEST_PROCESSES:-2}" --dist loadfile)
fi
python3 -m pytest -q --durations=25 "${parallel[@]}" "$@"
