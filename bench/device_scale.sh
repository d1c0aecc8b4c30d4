#!/usr/bin/env bash
# Several GPUs of one host, in stages (one call or several, the machine kept warm between):
#   build   installs this tree; DeepSpeed too when its sdist and wheels are in .whl/ (../shared/ANCHORS.md)
#   tests   the GPU tests of the distributed code that need several GPUs (test_distributed_cuda.py at 2
#           and 4 ranks where there are GPUs for them, resumes at another world size, two agents with a
#           worker killed; the 1-rank cases run in the one-GPU suite); $TESTS: another pytest -k
#   scale   bench/scale_bench.py on $MODEL (default l7b) at $NPROCS (default 1,2) for $MODES (default all),
#           hytrain capped at $CAP (default: DeepSpeed's reserved peak where DeepSpeed ran; GB per rank;
#           none); $ITERS/$WARMUP for hytrain, $BASE_ITERS/$BASE_WARMUP for the baselines; the node's host
#           update rate with 1 and N ranks at once first (the floor beside each hytrain record);
#           META_INIT=1: the model built on the meta device and sharded before it is allocated (32b, 50b);
#           WORKERS=N: hytrain's update workers per rank (default: its own)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Logs go to $OUT (or ./device-out).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh" 10
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for stage in "$@"; do
  case "$stage" in
    build)
      install_tree
      install_deepspeed ;;
    tests)
      timeout "${TEST_TIMEOUT:-560}" python3 -m pytest -v -m gpu -rs -p no:cacheprovider --durations 8 \
        tests/python/test_distributed_cuda.py -k "${TESTS:-not 1gpu}" \
        2>&1 | tee "$out/gpu_dist_tests.log" | tail -25 ;;
    scale)
      grep -E "MemTotal|MemAvailable" /proc/meminfo  # the default pool and host limits come from these
      python3 bench/scale_bench.py --model "${MODEL:-l7b}" --nprocs "${NPROCS:-1,2}" --batch "${BATCH:-2}" \
        --modes "${MODES:-deepspeed_offload,hytrain,hytrain_8bit,fsdp2_cpu_offload}" --cap "${CAP:-deepspeed}" \
        --warmup "${WARMUP:-6}" --iters "${ITERS:-10}" \
        --baseline-warmup "${BASE_WARMUP:-2}" --baseline-iters "${BASE_ITERS:-4}" --timeout "${TIMEOUT:-400}" \
        ${META_INIT:+--meta-init} ${WORKERS:+--workers "$WORKERS"} --floor-params "${FLOOR_PARAMS:-100000000}" \
        2>&1 | tee -a "$out/scale_${MODEL:-l7b}.txt" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
