#!/usr/bin/env bash
# The GPU machine's measurements in stages (one call or several, the machine kept warm):
#   build   installs this tree
#   deepspeed  DeepSpeed from .whl/ (carry it), for the stages that compare with it
#   gputests  the GPU tests (pytest -m gpu) of $GPU_TESTS (default: every test file), the log in
#           $OUT/gpu_tests.log; e.g. GPU_TESTS="tests/python/test_script_paths_cuda.py
#           tests/python/test_torch_contract_cuda.py" for what scripts do to the optimizer
#   settle  train_bench L3B at 27.13 GB, hytrain k = 0 with fp32, bf16 and 8-bit states ($SETTLE_MODES):
#           every iteration from the first (the settling phase) and the timed window's figures;
#           SETTLE_TREE=before runs the earlier version that `before_after.sh build` installed instead
#   wallclock  train_bench L3B, DeepSpeed ZeRO-Offload against hytrain held to DeepSpeed's GPU memory
#           ($WALL_MODES), wall-clock tokens/s over the timed window
#   practical  train_bench L3B, torch all-GPU against hytrain k = 0 at $ACCUMS micro-batches of 4 K
#           tokens a step (1 4 16: 4 K, 16 K, 64 K tokens); PRACTICAL_WORKLOAD=l7b
#           PRACTICAL_MODES=torch_gpu,hytrain_auto: L7B, hytrain held to 75 GB (torch needs an H200)
# Streamed weights on one GPU (a machine kind with a large host: nvidia-h100-x2 has 270 GB):
#   tests   test_window_cuda.py (streamed against resident, bit for bit), test_window.py, and
#           test_hybrid_adam_cuda.py (the resident pipeline the streamed blocks share)
#   speed   capacity_bench.py at $SPEED_SIZE (7b): resident (hytrain_8bit) against every layer
#           streamed (hytrain_stream_8bit --stream all), $BATCH x 1024 tokens a step (16: 16 K tokens)
#   cap     capacity_bench.py --sizes $SIZES (24b,30b) --systems $SYSTEMS (hytrain_stream_8bit), the
#           window planned by itself (--stream auto, --ends $ENDS: auto), $BATCH x 1024 tokens a step;
#           GPU_GB=24 holds each run to 24 GB of the GPU (a smaller card); resident systems too
#           (SIZES=20b SYSTEMS=hytrain_8bit BATCH=4: the first step's GPU memory, 4 K tokens)
#   job     bench/finetune_bench.py: `hytrain train --model DIR` of a $JOB_SIZE (32b) checkpoint written on the
#           host (kept for the next call: --reuse), $JOB_FORMAT (8bit) states, $JOB_BATCH x 1024 tokens a
#           step, timed from the command to its first step (the job's startup_s: model, optimizer, first
#           step); JOB_COLD=1 drops the page cache first (where the machine lets it), so the weights
#           come from the disk
#   ft      bench/finetune_bench.py --sizes $FT_SIZES --formats $FT_FORMATS (defaults: 7b, fp32) $FT_ARGS:
#           `hytrain train --model DIR` of checkpoints of those sizes, written on the host
#   probe   bench/reserve_probe.py: the state's host memory made alone and beside what a training
#           process adds (page-locked homes, CUDA, a busy GPU, busy cores), $PROBE_GB (128) GB each time
#   host    the host's CPUs and NUMA nodes, `hytrain info`, and bench/cpu_adam.py: one process's update
#           rate against 2 and 4 processes at once, and with the pool's pages spread or left local
#   placement  train_bench L3B at 27.13 GB (hytrain_k0, fp32 states: the host-bound case), pages left
#           local, then spread (HYTRAIN_PAGE_PLACEMENT), one invocation each, $PLACE_ITERS timed
#   timeline  train_bench L3B at 27.13 GB (hytrain_k0, fp32 states), one invocation per variant in
#           $VARIANTS ("default", "torch1": torch's intra-op threads 1, "workersN": N update workers,
#           "passive": OMP_WAIT_POLICY=passive, "spinN": idle update workers look for work N us before
#           sleeping; joined with "+", e.g. "workers32+spin50000"), each with a trace of its last $TRACE_KEEP iterations,
#           summarised per iteration by bench/trace_summary.py, and each iteration's page faults,
#           update-worker CPU and preemptions and the machine's steal (train_bench --counters)
# Logs go to $OUT (or ./device-out).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh"
for stage in "$@"; do
  case "$stage" in
    build) install_tree ;;
    deepspeed) install_deepspeed ;;
    gputests)
      # shellcheck disable=SC2086
      timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs ${GPU_TESTS:-tests/python} \
        > "$out/gpu_tests.log" 2>&1
      grep -E "^FAILED|^ERROR|passed|failed" "$out/gpu_tests.log" | cut -c1-240 | head -40 ;;
    settle)
      # SETTLE_TREE=before: the earlier version that `before_after.sh build` installed in /tmp/before
      tree=${SETTLE_TREE:-after}
      PYTHONPATH=$( [ "$tree" = before ] && echo /tmp/before || echo "${PYTHONPATH:-}" ) \
        python3 bench/train_bench.py --workloads l3b --modes "${SETTLE_MODES:-hytrain_k0,hytrain_k0_bf16,hytrain_k0_8bit}" \
        --cap-gb 27.13 --skip-nocap --no-profile --warmup 5 --iters "${ITERS_TIMED:-10}" >> "$out/settle_$tree.log" 2>&1
      python3 bench/summarise_runs.py "$out/settle_$tree.log" ;;
    wallclock)
      python3 bench/train_bench.py --workloads l3b --modes "${WALL_MODES:-deepspeed_offload,hytrain_k0,hytrain_k0_bf16}" \
        --cap-gb deepspeed --skip-nocap --no-profile --warmup 5 --iters "${ITERS_TIMED:-10}" > "$out/wallclock.log" 2>&1
      python3 bench/summarise_runs.py "$out/wallclock.log" ;;
    practical)
      for accum in ${ACCUMS:-1 4 16}; do
        python3 bench/train_bench.py --workloads "${PRACTICAL_WORKLOAD:-l3b}" \
          --modes "${PRACTICAL_MODES:-torch_gpu,hytrain_k0}" --accum "$accum" --no-profile \
          --warmup "${PRACTICAL_WARMUP:-4}" --iters "${PRACTICAL_ITERS:-6}" > "$out/practical_$accum.log" 2>&1
        python3 bench/summarise_runs.py "$out/practical_$accum.log"
      done ;;
    tests)
      timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rs \
        tests/python/test_window_cuda.py tests/python/test_window.py ${MORE_TESTS-tests/python/test_hybrid_adam_cuda.py} 2>&1 \
        | tee "$out/gpu_window.log" | grep -E "^FAILED|^ERROR|^E  .*Error|passed|failed" | cut -c1-240 | head -40 ;;
    speed)
      python3 bench/capacity_bench.py --sizes "${SPEED_SIZE:-7b}" --systems hytrain_8bit,hytrain_stream_8bit \
        --stream all --batch "${BATCH:-16}" --warmup "${WARMUP:-3}" --iters "${ITERS_TIMED:-5}" \
        --timeout "${CAP_TIMEOUT:-280}" --keep-going 2>&1 | tee "$out/stream_speed.log" \
        | grep -vE "^PROGRESS" | cut -c1-1500 | tail -12 ;;
    cap)
      python3 bench/capacity_bench.py --sizes "${SIZES:-24b,30b}" --systems "${SYSTEMS:-hytrain_stream_8bit}" \
        --batch "${BATCH:-16}" --warmup 1 --iters 2 --timeout "${CAP_TIMEOUT:-420}" --keep-going \
        --ends "${ENDS:-auto}" ${GPU_GB:+--gpu-gb "$GPU_GB"} 2>&1 \
        | tee "$out/stream_capacity.log" | grep -vE "^PROGRESS" | cut -c1-1500 | tail -12 ;;
    job)
      free -g | head -2; df -h /tmp | tail -1
      if [ "${JOB_COLD:-0}" = 1 ]; then sync; echo 3 > /proc/sys/vm/drop_caches && echo "page cache dropped"; fi
      python3 bench/finetune_bench.py --sizes "${JOB_SIZE:-32b}" --formats "${JOB_FORMAT:-8bit}" --steps "${JOB_STEPS:-4}" \
        --batch-size "${JOB_BATCH:-16}" --shards 2 --docs-per-shard 2000 --reuse 2>&1 | tee -a "$out/job.log" \
        | grep -v "Writing model shards" | tail -4
      free -g | head -2 ;;
    ft)
      # shellcheck disable=SC2086
      python3 bench/finetune_bench.py --sizes "${FT_SIZES:-7b}" --formats "${FT_FORMATS:-fp32}" ${FT_ARGS:-} 2>&1 \
        | tee -a "$out/finetune.log" | grep -v "Writing model shards" | tail -8
      free -g | head -2; df -h /tmp | tail -1 ;;
    probe)
      python3 bench/reserve_probe.py --gb "${PROBE_GB:-128}" 2>&1 | tee "$out/reserve_probe.log" | cut -c1-600 ;;
    host)
      { lscpu | grep -E "^Model name|^Socket|^NUMA|^CPU\(s\)|^Thread"; grep . /sys/devices/system/node/node*/cpulist
        python3 -m hytrain info; } 2>&1 | tee "$out/host.txt"
      python3 bench/cpu_adam.py --params "${HOST_PARAMS:-134217728}" --repeats 5 --processes 1,2,4 2>&1 \
        | tee "$out/cpu_adam.txt" | tail -13 ;;
    placement)
      for placement in local spread; do
        HYTRAIN_PAGE_PLACEMENT=$placement python3 bench/train_bench.py --workloads l3b --modes hytrain_k0 \
          --cap-gb 27.13 --skip-nocap --no-profile --warmup 5 --iters "${PLACE_ITERS:-10}" 2>&1 \
          | tee "$out/placement_$placement.log" | grep -E "^RESULT|^\{" | cut -c1-1200 | tail -3
      done ;;
    timeline)
      n=0
      for variant in ${VARIANTS:-default torch1}; do
        n=$((n + 1)); extra=(); envs=()
        for part in ${variant//+/ }; do
          case "$part" in
            torch1) extra+=(--torch-threads 1) ;;
            workers*) extra+=(--workers "${part#workers}") ;;
            passive) envs+=(OMP_WAIT_POLICY=passive) ;;
            spin*) envs+=(HYTRAIN_WORKER_SPIN_US="${part#spin}") ;;
          esac
        done
        env "${envs[@]}" python3 bench/train_bench.py --workloads l3b --modes "${TIMELINE_MODE:-hytrain_k0}" \
          --cap-gb 27.13 --skip-nocap --no-profile --warmup 5 --iters "${PLACE_ITERS:-10}" "${extra[@]}" \
          --trace "$out/trace_$n$variant" --trace-keep "${TRACE_KEEP:-6}" --counters > "$out/timeline_$n$variant.log" 2>&1
        python3 - "$out/timeline_$n$variant.log" "$n$variant" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith('{"mode"'):
        r = json.loads(line)
        keys = ("iter_s_median", "iter_s_mean", "iter_s_p90", "iter_s_max", "wall_tokens_per_s", "warmup", "k")
        print(sys.argv[2], {k: round(r[k], 3) if isinstance(r.get(k), float) else r.get(k) for k in keys})
        print("  iterations", r.get("iter_times_s"))
        print("  threads", json.dumps(r.get("thread_cpu")))
        # each iteration from the first: s, the update workers' cores, page faults, preemptions, steal
        for t, c in zip(r.get("iter_times_s", []), r.get("iter_counters", [])):
            print(f"  iter {t:7.3f} s  workers {c.get('workers_cpu_s', 0) / t:5.1f} cores  minflt {c.get('minflt')}"
                  f"  majflt {c.get('majflt')}  preempted {c.get('workers_preempted')}  steal {c.get('steal_s')} s")
PY
        python3 bench/trace_summary.py "$out"/trace_$n$variant.*.json | cut -c1-220 | head -4
      done ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
