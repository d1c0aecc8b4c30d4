# Sourced by the GPU-machine scripts (device_run.sh, device_e2e.sh, before_after.sh) with the default
# number of timed iterations: the repository root as working directory, $out (from $OUT, else
# ./device-out) created, unbuffered Python output, and $iters (ITERS, else that default); and
# the build stage's steps: install_tree (the GPU named in $out/device.txt, this tree installed) and
# install_deepspeed (DeepSpeed's sdist and its wheels from .whl/, as ../shared/ANCHORS.md says, into
# /tmp/site, put on PYTHONPATH; nothing where .whl/ has no DeepSpeed) and install_megatrain (MegaTrain's
# source archive from .whl/ into /tmp/site the same way; nothing where .whl/ has none).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-device-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
iters=${ITERS:-${1:-10}}
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site; fi  # DeepSpeed, installed by an earlier call

install_tree() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
  python3 -m pip install -q --no-build-isolation --no-deps -Cbuild-dir=build/pip . 2>&1 | tail -3
}

install_deepspeed() {
  ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
    .whl/deepspeed-*.tar.gz 2>&1 | tail -2
  export PYTHONPATH=/tmp/site
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
}

install_megatrain() {
  local src ok=1
  src=$(ls .whl/megatrain-*.tar.gz 2>/dev/null | head -1)
  [ -n "$src" ] || return 0
  # Its setup.py builds its cuda_pipeline extension where torch sees a GPU (nothing on the single-GPU
  # training path imports it): MEGATRAIN_CUDA_EXT=0, or a build that fails, installs it without.
  if [ "${MEGATRAIN_CUDA_EXT:-1}" = 1 ]; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation --target /tmp/site "$src" 2>&1 \
      | tail -2
    ok=${PIPESTATUS[0]}
  fi
  if [ "$ok" != 0 ]; then
    echo "megatrain: installing without its cuda_pipeline extension"
    CUDA_VISIBLE_DEVICES= python3 -m pip install -q --upgrade --no-index --no-deps --no-build-isolation \
      --target /tmp/site "$src" 2>&1 | tail -2
  fi
  export PYTHONPATH=/tmp/site
  python3 -c "import importlib.metadata as m, importlib.util as u; import infinity; \
print('megatrain', m.version('megatrain'), 'cuda_pipeline', u.find_spec('cuda_pipeline') is not None)" 2>&1 | tail -1
}
