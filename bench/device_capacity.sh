#!/usr/bin/env bash
# The first step's GPU memory, on one GPU, in stages (one call or several, the machine kept warm):
#   build   installs this tree
#   tests   test_hybrid_adam_cuda.py (the first backward's hand-offs and refusals among its cases)
#   cap     capacity_bench.py --sizes $SIZES --systems $SYSTEMS (defaults: 20b, hytrain_8bit), one
#           warm-up and two timed iterations per run, each run bounded by $CAP_TIMEOUT seconds
# Logs go to $OUT (or ./device-out).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh"
for stage in "$@"; do
  case "$stage" in
    build) install_tree ;;
    tests)
      timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
        tests/python/test_hybrid_adam_cuda.py 2>&1 | tee "$out/gpu_hybrid_adam.log" \
        | grep -E "^FAILED|^ERROR|^E  .*Error|passed|failed" | cut -c1-240 | head -40 ;;
    cap)
      python3 bench/capacity_bench.py --sizes "${SIZES:-20b}" --systems "${SYSTEMS:-hytrain_8bit}" \
        --warmup 1 --iters 2 --timeout "${CAP_TIMEOUT:-420}" --keep-going 2>&1 | tee "$out/capacity.log" \
        | grep -vE "^PROGRESS" | cut -c1-400 | tail -30 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
