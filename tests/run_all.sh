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
python3 -m pytest -q --durations=25 "$@"
