#!/usr/bin/env bash
# What scripts do to the optimizer, on one GPU, in stages (one call or several, the machine kept warm):
#   build   installs this tree, and the tree in $BEFORE (a `git archive` tarball of an earlier version)
#           into /tmp/before, both at once
#   tests   the GPU cases of test_script_paths_cuda.py and the contract's (test_torch_contract_cuda.py)
#   l3b|l7b train_bench before and after (bench/before_after.sh): the earlier version's hytrain_auto,
#           this one's hytrain_auto and hytrain_nowatch (watch_writes=False: what the fingerprints cost)
# Logs go to $OUT (or ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device-out}
mkdir -p "$out"
for stage in "$@"; do
  case "$stage" in
    build)
      if [ -n "${BEFORE:-}" ]; then
        (python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/before "$BEFORE" \
          > "$out/before_build.log" 2>&1) & bpid=$!
      fi
      bash bench/before_after.sh build 2>&1 | tail -3
      [ -n "${BEFORE:-}" ] && { wait "$bpid"; echo "before: $(ls /tmp/before | tr '\n' ' ')"; } ;;
    tests)
      timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
        tests/python/test_script_paths_cuda.py tests/python/test_torch_contract_cuda.py 2>&1 \
        | tee "$out/gpu_script_paths.log" | grep -E "^FAILED|^SKIPPED|^E  .*Error|passed|failed" | cut -c1-240 | head -40 ;;
    l3b|l7b)
      MODES=${MODES:-hytrain_auto,hytrain_nowatch} bash bench/before_after.sh "$stage" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
