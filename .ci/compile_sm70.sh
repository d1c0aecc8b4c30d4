#!/usr/bin/env bash
# Checks that cuda/ builds for sm_70 (V100), which CUDA 13's nvcc no longer targets.
#
# The CUDA 12 compiler driver is not on PyPI: the nvidia-cuda-nvcc-cu12 wheel carries ptxas and
# libnvvm only. So the front end is this machine's nvcc, emitting PTX for its lowest virtual
# architecture (compute_75, with __CUDA_ARCH__ = 750), and the CUDA 12 ptxas from that wheel
# assembles the PTX for sm_70. ptxas rejects any instruction sm_70 lacks, so an unguarded sm_80+
# intrinsic (bf16 arithmetic, cp.async, redux, ...) fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
nvcc_bin=${NVCC:-nvcc}
if ! command -v "$nvcc_bin" >/dev/null; then
  echo "compile_sm70: no nvcc on this machine; nothing to check"; exit 0
fi
work=${HYTRAIN_SM70_DIR:-build/sm70}
mkdir -p "$work"
if [ ! -x "$work/cu12/nvidia/cuda_nvcc/bin/ptxas" ]; then
  if ! python3 -m pip install -q --disable-pip-version-check --target "$work/cu12" \
      "nvidia-cuda-nvcc-cu12==12.9.*" >"$work/pip.log" 2>&1; then
    tail -5 "$work/pip.log"
    echo "compile_sm70: SKIPPED, nvidia-cuda-nvcc-cu12 could not be installed"; exit 0
  fi
fi
ptxas="$work/cu12/nvidia/cuda_nvcc/bin/ptxas"
echo "compile_sm70: front end $("$nvcc_bin" --version | grep -o 'release [0-9.]*'), ptxas $("$ptxas" --version | grep -o 'release [0-9.]*')"
for cu in cuda/*.cu; do
  name=$(basename "$cu" .cu)
  "$nvcc_bin" -std=c++17 -O3 -arch=compute_75 -ptx -Icore/include -Icuda/include -Icuda \
    "$cu" -o "$work/$name.ptx"
  # Retarget: same instructions, sm_70 target, a PTX ISA version CUDA 12.9's ptxas reads.
  sed -i -e 's/^\.target sm_75/.target sm_70/' -e 's/^\.version [0-9.]*/.version 8.8/' "$work/$name.ptx"
  "$ptxas" -arch=sm_70 -O3 "$work/$name.ptx" -o "$work/$name.sm_70.cubin"
  echo "compile_sm70: $cu -> sm_70 ok ($(stat -c %s "$work/$name.sm_70.cubin") bytes)"
done
