# Sourced by the GPU-machine scripts (device_run.sh, device_e2e.sh, before_after.sh) with the default
# number of timed iterations: the repository root as working directory, $out (from $OUT, else
# ./device-out) created, unbuffered Python output, and $iters (ITERS, else that default).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
iters=${ITERS:-${1:-10}}
