#!/usr/bin/env bash
# Baselines for the streamed-weights benchmark on its workload (capacity_bench.py's Llama shapes,
# $BATCH x 1024 synthetic tokens a step): MegaTrain and DeepSpeed ZeRO-3 with parameters and optimizer
# offloaded, each where .whl/ carries it. Use the machine kind of the streamed runs (nvidia-h100-x2:
# 270 GB of host memory; GPU 0 is used). In stages (one call or several, the machine kept warm):
#   build      installs this tree, DeepSpeed and MegaTrain (from .whl/ into /tmp/site), and builds
#              DeepSpeed's CPU Adam, which both baselines step (its JIT cache serves later calls)
#   megatrain  megatrain_bench.py --size $SIZE (7b) --batch $BATCH (16) --mask $MASK (none: sdpa causal),
#              $WARMUP (2) untimed and $ITERS_TIMED (5) timed iterations, bounded by $MT_TIMEOUT (540) s
#   versus     one invocation at $SIZE (7b) and $BATCH: hytrain as a user runs it (capacity_bench.py
#              hytrain: fp32 states, streamed only where needed, which at 7b is never), hytrain with every
#              layer streamed (hytrain_stream --stream all), then MegaTrain (as the megatrain stage);
#              hytrain's runs accumulate micro-batches of $MICRO sequences ($BATCH: one), MegaTrain takes
#              the whole batch in one forward and backward, as its configs do (its loss is chunked)
#   mtcheck    the megatrain stage with torch's caching allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1:
#              no memory freed on one stream is handed to another before the device is idle), to tell
#              whether its NaN comes from memory reused while a copy still reads it
#   zero3      capacity_bench.py --systems deepspeed_zero3_offload --sizes $SIZES (7b) --batch $BATCH,
#              the same iterations, each run bounded by $CAP_TIMEOUT (540) s
# Logs go to $OUT (or ./device-out).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh"
for stage in "$@"; do
  case "$stage" in
    build)
      install_tree
      install_deepspeed
      install_megatrain
      if python3 -c "import deepspeed" >/dev/null 2>&1; then
        python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); \
print('DeepSpeed CPU Adam built')" 2>&1 | tail -1
      fi ;;
    megatrain)
      python3 bench/megatrain_bench.py --size "${SIZE:-7b}" --batch "${BATCH:-16}" --seq 1024 --mask "${MASK:-none}" \
        --warmup "${WARMUP:-2}" --iters "${ITERS_TIMED:-5}" --timeout "${MT_TIMEOUT:-540}" \
        --log "$out/megatrain_child.log" 2>&1 | tee "$out/megatrain.log" | cut -c1-3000 | tail -8 ;;
    versus)
      python3 bench/capacity_bench.py --sizes "${SIZE:-7b}" --systems hytrain,hytrain_stream --stream all \
        --batch "${BATCH:-16}" --micro-batch "${MICRO:-${BATCH:-16}}" --warmup "${WARMUP:-2}" --iters "${ITERS_TIMED:-5}" --timeout "${CAP_TIMEOUT:-540}" \
        --keep-going 2>&1 | tee "$out/versus_hytrain.log" | grep -vE "^PROGRESS" | cut -c1-1500 | tail -6
      python3 bench/megatrain_bench.py --size "${SIZE:-7b}" --batch "${BATCH:-16}" --seq 1024 --mask "${MASK:-none}" \
        --warmup "${WARMUP:-2}" --iters "${ITERS_TIMED:-5}" --timeout "${MT_TIMEOUT:-540}" \
        --log "$out/megatrain_child.log" 2>&1 | tee "$out/versus_megatrain.log" | cut -c1-3000 | tail -3 ;;
    mtcheck)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 python3 bench/megatrain_bench.py --size "${SIZE:-7b}" --batch "${BATCH:-16}" \
        --seq 1024 --mask "${MASK:-none}" --warmup "${WARMUP:-2}" --iters "${ITERS_TIMED:-5}" \
        --timeout "${MT_TIMEOUT:-540}" --log "$out/mtcheck_child.log" 2>&1 | tee "$out/mtcheck.log" | cut -c1-3000 | tail -3 ;;
    zero3)
      python3 bench/capacity_bench.py --sizes "${SIZES:-7b}" --systems deepspeed_zero3_offload \
        --batch "${BATCH:-16}" --warmup "${WARMUP:-2}" --iters "${ITERS_TIMED:-5}" --timeout "${CAP_TIMEOUT:-540}" \
        --keep-going 2>&1 | tee "$out/zero3.log" | grep -vE "^PROGRESS" | cut -c1-1500 | tail -12 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
