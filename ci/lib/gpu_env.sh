# Sourced by ci/gpu_all, ci/gpu_e2e and ci/gpu_bench: the environment of the GPU checks on an offline machine.
#
# The target: one GPU, no network, a Python with a preinstalled CUDA torch, no Ray, no megatron-core, and only what
# is carried in with the tree (at most 64 MiB). So nothing here needs Ray or pytest: the train ranks start through
# torch.multiprocessing (slime_ext.rollout.processes) and the checks are plain Python (tests/e2e/gpu_e2e.py,
# bench/gpu_replay.py). Two wheels are carried, built on a connected machine by ci/build_wheelhouse:
# megatron-core (~2.6 MB, without its dependencies) and slime-ext's own.
#
#   PYTHON=/path/to/python          the Python whose torch is a CUDA build (default: python3); never modified
#   SLIME_EXT_WHEELHOUSE=DIR         the carried wheels (default: ./wheelhouse)
#   SLIME_EXT_GPU_SITE=DIR           where they are unpacked (default: .gpu-site): `pip install --target`, or plain
#                                    unzipping where PYTHON has no pip; it is put first on PYTHONPATH
#
# gpu_env_setup checks PYTHON's torch (a CUDA build that sees a GPU, unless GPU_ENV_CPU_OK=1: the dry run), installs
# the wheels offline, then checks that torch, megatron-core and slime-ext import from where they should (torch from
# PYTHON's own environment, unchanged; megatron-core and slime-ext from the wheels) and that numpy and packaging,
# which megatron-core needs, are there. After it, `gpu_env_run ARGS...` runs PYTHON with that path and `-P` (the
# working directory is not put first: slime_ext comes from the wheel; bench/ from the tree).
#
# Every refusal exits with status 2 and says what is missing and how to fix it.

gpu_env_refuse() {  # message; exit status 2 = this machine cannot run the script
  echo "$GPU_SCRIPT: $1" >&2
  exit 2
}

gpu_env_require_gpu() {
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    gpu_env_refuse "no NVIDIA GPU here (nvidia-smi -L failed); run it on a GPU machine${GPU_DRY_RUN_HINT:-}"
  fi
  nvidia-smi -L
}

GPU_ENV_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

gpu_env_run() {  # the interpreter with the carried wheels first on the path
  PYTHONPATH="$GPU_ENV_SITE:$GPU_ENV_REPO${GPU_ENV_EXTRA_PATH:+:$GPU_ENV_EXTRA_PATH}" "$GPU_ENV_PYTHON" -P "$@"
}

gpu_env_setup() {
  GPU_ENV_PYTHON="${PYTHON:-python3}"
  command -v "$GPU_ENV_PYTHON" >/dev/null 2>&1 || gpu_env_refuse "PYTHON=$GPU_ENV_PYTHON is not an executable"
  "$GPU_ENV_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || gpu_env_refuse "PYTHON=$GPU_ENV_PYTHON is older than Python 3.11 (the scripts run it with -P)"
  # the machine's torch, before anything is installed: it must be a CUDA build that sees a GPU
  local torch_before
  torch_before=$("$GPU_ENV_PYTHON" - <<'PYEOF'
import os
import sys
try:
    import torch
except ImportError:
    sys.exit("no torch in this Python: install the machine's CUDA build of torch first (this script never installs torch)")
if not torch.cuda.is_available() and os.environ.get("GPU_ENV_CPU_OK") != "1":
    sys.exit(f"torch {torch.__version__} sees no CUDA device (a CPU build, or no driver); point PYTHON at the Python with the CUDA torch")
print(f"{torch.__version__} {torch.__file__}")
PYEOF
  ) || gpu_env_refuse "PYTHON=$GPU_ENV_PYTHON: see the line above"
  local wheels="${SLIME_EXT_WHEELHOUSE:-wheelhouse}"
  local pyver
  pyver=$("$GPU_ENV_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  if ! ls "$wheels"/slime_ext-*.whl >/dev/null 2>&1 || ! ls "$wheels"/megatron_core-*.whl >/dev/null 2>&1; then
    gpu_env_refuse "no slime-ext and megatron-core wheels in $wheels (SLIME_EXT_WHEELHOUSE); build them on a connected machine with ci/build_wheelhouse --python $pyver DIR and carry DIR in"
  fi
  local carried
  carried=$(du -sk "$wheels" | cut -f1)
  echo "wheelhouse $wheels: $(ls "$wheels" | tr '\n' ' ')($((carried / 1024)) MiB)"
  GPU_ENV_SITE="$(mkdir -p "${SLIME_EXT_GPU_SITE:-.gpu-site}" && cd "${SLIME_EXT_GPU_SITE:-.gpu-site}" && pwd)"
  rm -rf "${GPU_ENV_SITE:?}"/*
  if "$GPU_ENV_PYTHON" -m pip --version >/dev/null 2>&1; then
    "$GPU_ENV_PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$GPU_ENV_SITE" \
      "$wheels"/*.whl || gpu_env_refuse "installing from $wheels failed (are the wheels built for Python $pyver and this platform?)"
  else  # a wheel is a zip of what goes into site-packages
    "$GPU_ENV_PYTHON" - "$GPU_ENV_SITE" "$wheels"/*.whl <<'PYEOF' || gpu_env_refuse "unpacking $wheels failed"
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
PYEOF
  fi
  GPU_ENV_TORCH_BEFORE="$torch_before"
  gpu_env_run - <<'PYEOF' || gpu_env_refuse "the environment is not what the checks need: see the line above"
import os
import sys

site = os.environ["PYTHONPATH"].split(os.pathsep)[0]
try:
    import numpy, packaging  # megatron-core's own dependencies, not carried by default
except ImportError as exc:
    sys.exit(f"{exc}: megatron-core needs numpy and packaging; add them to the wheelhouse (ci/build_wheelhouse --with-deps)")
import torch
import megatron.core
import slime_ext

want = os.environ["GPU_ENV_TORCH_BEFORE"]
got = f"{torch.__version__} {torch.__file__}"
if got != want:
    sys.exit(f"torch changed: {want} -> {got}; refusing to run on a torch we did not choose")
for name, module in (("megatron-core", megatron.core), ("slime-ext", slime_ext)):
    if not os.path.realpath(module.__file__).startswith(os.path.realpath(site)):
        sys.exit(f"{name} was imported from {module.__file__}, not from the carried wheel in {site}")
gpus = f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, {gpus}), "
      f"megatron-core {megatron.core.__version__} and slime-ext from {site}")
PYEOF
}
export GPU_ENV_TORCH_BEFORE
