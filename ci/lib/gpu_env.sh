# Sourced by ci/gpu_e2e and ci/gpu_bench: find a Python with a CUDA torch already installed and add our packages to
# it from a local wheel folder, without the network and without touching torch.
#
#   PYTHON=/path/to/python          a Python whose torch is a CUDA build (default: python3)
#   SLIME_EXT_WHEELHOUSE=DIR         wheels from ci/build_wheelhouse --python X.Y DIR (default: ./wheelhouse)
#   SLIME_EXT_GPU_VENV=DIR           where our packages go: a venv over PYTHON's site-packages (default .venv-gpu);
#                                    "none" installs into PYTHON's own environment (use it when PYTHON is a venv)
#
# After gpu_env_setup, $PY is the interpreter to run. GPU_ENV_CPU_OK=1 (ci/gpu_bench --dry-run only) accepts a CPU
# torch, so that the offline install can be checked on a machine without a GPU.

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

gpu_env_setup() {
  local base="${PYTHON:-python3}"
  command -v "$base" >/dev/null 2>&1 || gpu_env_refuse "PYTHON=$base is not an executable"
  # the machine's torch, before anything is installed: it must be a CUDA build that sees a GPU
  local torch_before
  torch_before=$("$base" - <<'PYEOF'
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
  ) || gpu_env_refuse "PYTHON=$base: see the line above"
  local venv="${SLIME_EXT_GPU_VENV:-.venv-gpu}"
  if [ "$venv" = "none" ]; then
    PY="$base"
  else
    if [ ! -x "$venv/bin/python" ]; then
      if "$base" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
        gpu_env_refuse "PYTHON=$base is itself a virtualenv: a venv over it would not see its torch; set SLIME_EXT_GPU_VENV=none to install into it"
      fi
      "$base" -m venv --system-site-packages "$venv"
    fi
    PY="$venv/bin/python"
  fi
  local wheels="${SLIME_EXT_WHEELHOUSE:-wheelhouse}"
  if [ ! -d "$wheels" ] || ! ls "$wheels"/slime_ext-*.whl >/dev/null 2>&1; then
    gpu_env_refuse "no wheel folder at $wheels (SLIME_EXT_WHEELHOUSE); build it on a connected machine with ci/build_wheelhouse --python $("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') DIR and copy it here"
  fi
  "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheels" \
    "megatron-core>=0.16,<0.17" "ray>=2.40" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "hypothesis>=6.100" \
    "pyyaml>=6" || gpu_env_refuse "installing from $wheels failed (is it built for this Python and platform?)"
  # slime-ext itself: the wheel built from this checkout, replacing an older install
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --force-reinstall "$wheels"/slime_ext-*.whl
  local torch_after
  torch_after=$("$PY" -c 'import torch; print(f"{torch.__version__} {torch.__file__}")')
  if [ "$torch_after" != "$torch_before" ]; then
    gpu_env_refuse "torch changed during the install ($torch_before -> $torch_after); refusing to run on a torch we did not choose"
  fi
  "$PY" - <<'PYEOF'
import torch, megatron.core, ray
gpus = f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, {gpus}), megatron-core {megatron.core.__version__}, "
      f"ray {ray.__version__}")
PYEOF
}
