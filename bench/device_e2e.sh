#!/usr/bin/env bash
# End-to-end runs on a GPU machine, in stages: `bash bench/device_e2e.sh build tests l3b l7b`.
#   build  installs hytrain (incremental build in build/pip) and, when .whl/ holds them, DeepSpeed and
#          its missing dependencies into /tmp/site (see ../shared/ANCHORS.md)
#   tests  the whole Python test suite, GPU tests included
#   l3b    bench/train_bench.py on L3B, hytrain capped at DeepSpeed's GPU memory, plus auto uncapped
#   l7b    bench/train_bench.py on L7B (torch_gpu and hytrain auto capped at 75 GB), with a trace
#   trainer bench/trainer_bench.py: transformers' Trainer with torch's AdamW and each HybridAdamW path
# Logs and results go to $OUT (or ./device-out). ITERS timed iterations per mode (default 10: the median
# then stands on steady-state iterations even when a k change or the first speculation falls in them).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh" 10
for stage in "$@"; do
  case $stage in
    build)
      install_tree
      free -g | head -2 | tee -a "$out/device.txt"
      install_deepspeed ;;
    tests)
      python3 -m pytest -q -rs tests/python 2>&1 | tee "$out/tests_e2e.log" | tail -15 ;;
    l3b)
      python3 bench/train_bench.py --workloads l3b --iters "$iters" --cap-gb deepspeed ${L3B_MODES:+--modes $L3B_MODES} 2>&1 \
        | tee "$out/train_bench_l3b.txt" ;;
    l3b_extra)  # the modes not capped by DeepSpeed's memory: auto without a cap, the naive offload
      python3 bench/train_bench.py --workloads l3b --iters "$iters" --modes torch_gpu,hytrain_auto,naive_offload 2>&1 \
        | tee "$out/train_bench_l3b_extra.txt" ;;
    l7b)
      python3 bench/train_bench.py --workloads l7b --iters "$iters" --trace "$out/trace" 2>&1 | tee "$out/train_bench_l7b.txt" ;;
    trainer)
      python3 bench/trainer_bench.py ${TRAINER_ARGS:-} 2>&1 | tee "$out/trainer_bench.txt" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
