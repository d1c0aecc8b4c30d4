#!/usr/bin/env bash
# The precision paths on a GPU machine, in stages (one call or several, the machine kept warm):
#   build   installs this tree (the GPU named in $out/device.txt)
#   tests   the GPU tests of loss scaling, speculation and clipping (test_hybrid_adam_cuda.py -k $TESTS),
#           then the whole file with ALL=1
#   fp16    train_bench: bf16 weights against fp16 weights under a GradScaler, L3B at DeepSpeed's
#           reserved peak ($CAP_GB, default 27.13 GB: ../shared/ANCHORS.md) and uncapped, L7B at 75 GB
#           ($WORKLOADS, default l3b,l7b)
#   q8      bench/cpu_adam.py (the 8-bit rate beside the triad), then train_bench L3B at $CAP_GB with
#           fp32, bf16 and 8-bit states (DeepSpeed ZeRO-Offload first where .whl/ holds it and DS=1)
# Logs go to $OUT (or ./device-out).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh" 12
cap=${CAP_GB:-27.13}
for stage in "$@"; do
  case "$stage" in
    build) install_tree ;;
    tests)
      sel=(-k "${TESTS:-fp16 or scaler or speculat or clipping}")
      [ -n "${ALL:-}" ] && sel=()
      timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
        tests/python/test_hybrid_adam_cuda.py "${sel[@]}" 2>&1 | tee "$out/gpu_tests.log" \
        | grep -E "^FAILED|^ERROR|^E  |passed|failed" | cut -c1-300 | head -40 ;;
    fp16)
      for w in $(echo "${WORKLOADS:-l3b,l7b}" | tr , ' '); do
        if [ "$w" = l3b ]; then
          python3 bench/train_bench.py --workloads l3b --modes hytrain_auto,hytrain_auto_fp16 --cap-gb "$cap" \
            --iters "$iters" --no-profile --skip-nocap 2>&1 | grep -E '^\{|Error' | tee -a "$out/fp16_l3b_cap.txt" | cut -c1-400
          python3 bench/train_bench.py --workloads l3b --modes hytrain_auto,hytrain_auto_fp16 \
            --iters "$iters" --no-profile 2>&1 | grep -E '^\{|Error' | tee -a "$out/fp16_l3b_nocap.txt" | cut -c1-400
        else
          python3 bench/train_bench.py --workloads l7b --modes hytrain_auto,hytrain_auto_fp16 \
            --l7b-modes hytrain_auto,hytrain_auto_fp16 --l7b-cap-gb 75 --iters "$iters" --no-profile 2>&1 \
            | grep -E '^\{|Error' | tee -a "$out/fp16_l7b.txt" | cut -c1-400
        fi
      done ;;
    q8)
      python3 bench/cpu_adam.py --params $((256 * 2**20)) --threads 15 2>&1 | tee "$out/cpu_adam.txt"
      modes=hytrain_auto,hytrain_auto_bf16,hytrain_auto_8bit
      if [ -n "${DS:-}" ]; then install_deepspeed; modes=deepspeed_offload,$modes; fi
      python3 bench/train_bench.py --workloads l3b --modes "$modes" --cap-gb "$cap" --iters "$iters" \
        --no-profile --skip-nocap 2>&1 | grep -E '^\{|Error' | tee -a "$out/q8_l3b.txt" | cut -c1-400 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
