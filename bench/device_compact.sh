#!/usr/bin/env bash
# Compact optimizer states (state_format="bf16" and "8bit") on a GPU machine, in stages (each one call or several
# in one, the machine kept warm between):
#   build     installs this tree; DeepSpeed too when its sdist and wheels are in .whl/
#             (../shared/ANCHORS.md says which), for the same-run baseline
#   tests     the 8-bit kernel's C++ test (every SIMD path this CPU runs), the compact- and 8-bit-state
#             GPU tests, then the CUDA AdamW and HybridAdamW GPU tests
#   l3b       train_bench L3B at DeepSpeed ZeRO-Offload's reserved peak (27.1 GB when DeepSpeed is not
#             installed): DeepSpeed, then hytrain with each of $MODES (default: k auto and k = 0 with
#             fp32, bf16 and 8-bit states)
#   l7b       train_bench L7B at 75 GB: hytrain k auto with each of $L7B_MODES (default: fp32, bf16
#             and 8-bit states; host peaks)
#   converge  `hytrain train` on the 125m preset for $STEPS steps (default 2000), fp32, bf16 and
#             8-bit states ($FORMATS, default "fp32 bf16 8bit"), same seed ($SEED, default 0) and data; $PRESETS
#             overrides the presets (e.g. "125m 1b"); a run is stopped after $TRAIN_TIMEOUT seconds
#             (default 3600), its metrics kept
# Logs go to $OUT (or ./device-out).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh" 16
for stage in "$@"; do
  case "$stage" in
    build)
      install_tree
      install_deepspeed ;;
    tests)
      cmake -S . -B /tmp/ctest -G Ninja -DHYTRAIN_BUILD_TESTS=ON -DHYTRAIN_BUILD_PYTHON=OFF -DHYTRAIN_ENABLE_CUDA=OFF > /dev/null &&
        cmake --build /tmp/ctest --target test_q8_states test_compact_states > /dev/null &&
        { /tmp/ctest/tests/cpp/test_q8_states; /tmp/ctest/tests/cpp/test_compact_states; } 2>&1 | tee "$out/cpp_tests.log" | grep -v "^\[ ok" ;
      timeout 500 python3 -m pytest -q -m gpu -x -rs tests/python/test_q8_states.py tests/python/test_compact_states.py \
        tests/python/test_cuda_adam.py tests/python/test_hybrid_adam_cuda.py 2>&1 | tee "$out/gpu_tests.log" | tail -8 ;;
    l3b)
      if [ -d /tmp/site/deepspeed ]; then cap=deepspeed; modes=deepspeed_offload,; else cap=27.1; modes=; fi
      python3 bench/train_bench.py --workloads l3b --cap-gb "$cap" --skip-nocap --no-profile \
        --iters "$iters" --modes "${modes}${MODES:-hytrain_auto,hytrain_auto_bf16,hytrain_auto_8bit,hytrain_k0,hytrain_k0_bf16,hytrain_k0_8bit}" \
        2>&1 | tee "$out/train_bench_l3b.txt" ;;
    l7b)
      python3 bench/train_bench.py --workloads l7b --l7b-cap-gb 75 --no-profile --iters "$iters" \
        --l7b-modes "${L7B_MODES:-hytrain_auto,hytrain_auto_bf16,hytrain_auto_8bit}" --modes "${L7B_MODES:-hytrain_auto,hytrain_auto_bf16,hytrain_auto_8bit}" \
        2>&1 | tee "$out/train_bench_l7b.txt" ;;
    converge)
      for preset in ${PRESETS:-125m}; do
        for fmt in ${FORMATS:-fp32 bf16 8bit}; do
          run=/tmp/converge_${preset}_${fmt}_s${SEED:-0}  # checkpoints stay on the machine; summaries come back
          rm -rf "$run"
          timeout "${TRAIN_TIMEOUT:-3600}" python3 -m hytrain train --model "$preset" --steps "${STEPS:-2000}" --eval-every 500 --eval-batches 32 \
            --state-format "$fmt" --seed "${SEED:-0}" --out "$run" --no-progress 2>&1 | tail -6 | tee "$out/$(basename "$run").txt"
          cp "$run/summary.json" "$out/$(basename "$run")_summary.json" 2>/dev/null
          cp "$run/metrics.jsonl" "$out/$(basename "$run")_metrics.jsonl" 2>/dev/null
        done
      done ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
