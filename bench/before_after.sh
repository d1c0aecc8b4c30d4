#!/usr/bin/env bash
# A change measured against an earlier version on a GPU machine, in stages (each one call or all in one,
# the machine kept warm between):
#   build   installs this tree, and the tree given in $BEFORE (a source tree of an earlier version, e.g.
#           from `git archive`) into /tmp/before, both at once, for the before/after benchmark in one run
#   tests   the GPU tests (pytest -m gpu)
#   l3b     train_bench L3B ($REPS times, default 1) at 27.1 GB (DeepSpeed ZeRO-Offload's reserved peak on an H200): the earlier
#           version's hytrain_auto, then this one's $MODES (default hytrain_auto and hytrain_nofence;
#           MODES=hytrain_auto,hytrain_nowatch: what the write watch's fingerprints cost)
#   l7b     train_bench L7B at 75 GB: the earlier version's hytrain_auto, then this one's
#           ($HOST_LIMIT_GB: and this one's within that host memory limit, host_memory_limit)
#   host    bench/host_overhead.py (the optimizer's per-step Python cost), the earlier version's, then this one's
# Logs go to $OUT (or ./device-out).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh" 16
for stage in "$@"; do
  case "$stage" in
    build)
      if [ -n "${BEFORE:-}" ]; then
        (python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/before "$BEFORE" \
          > "$out/before_build.log" 2>&1) & bpid=$!
      fi
      install_tree
      if [ -n "${BEFORE:-}" ]; then
        wait "$bpid"; tail -3 "$out/before_build.log"; echo "before: $(ls /tmp/before | tr '\n' ' ')"
      fi ;;
    tests)
      timeout 540 python3 -m pytest -q -m gpu tests/python -x -rs 2>&1 | tee "$out/gpu_tests.log" | tail -15 ;;
    l3b|l7b)
      caps=(--cap-gb 27.1)
      [ "$stage" = l7b ] && caps=(--l7b-cap-gb 75)
      modes=${MODES:-hytrain_auto,hytrain_nofence}
      for rep in $(seq "${REPS:-1}"); do  # before, after, after without the fence; again
        if [ -d /tmp/before ]; then
          PYTHONPATH=/tmp/before python3 bench/train_bench.py --workloads "$stage" --modes hytrain_auto \
            --l7b-modes hytrain_auto "${caps[@]}" --iters "$iters" --no-profile --skip-nocap 2>&1 \
            | grep -E '^\{|Error' | tee -a "$out/${stage}_before.txt" | cut -c1-300
        fi
        python3 bench/train_bench.py --workloads "$stage" --modes "$modes" --l7b-modes "$modes" "${caps[@]}" \
          --iters "$iters" --no-profile --skip-nocap 2>&1 | grep -E '^\{|Error' \
          | tee -a "$out/${stage}_after.txt" | cut -c1-300
        if [ -n "${HOST_LIMIT_GB:-}" ]; then  # this one's hytrain_auto within a host memory limit
          python3 bench/train_bench.py --workloads "$stage" --modes hytrain_auto --l7b-modes hytrain_auto \
            "${caps[@]}" --host-limit-gb "$HOST_LIMIT_GB" --iters "$iters" --no-profile --skip-nocap 2>&1 \
            | grep -E '^\{|Error' | tee -a "$out/${stage}_after_host${HOST_LIMIT_GB}.txt" | cut -c1-300
        fi
      done ;;
    host)
      for rep in $(seq "${REPS:-1}"); do
        if [ -d /tmp/before ]; then
          PYTHONPATH=/tmp/before python3 bench/host_overhead.py 2>&1 | tail -2 | tee -a "$out/host_before.txt" | cut -c1-300
        fi
        python3 bench/host_overhead.py 2>&1 | tail -2 | tee -a "$out/host_after.txt" | cut -c1-300
      done ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
