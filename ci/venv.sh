# Sourced by ci/test and ci/demo: `ensure_venv EXTRAS` makes "$VENV" ready and sets PY to its python.
#
# VENV              the virtualenv (ci/test and ci/demo: ${SLIME_EXT_VENV:-.venv}); created with ${PYTHON:-python3}
#                   when missing.
# SLIME_EXT_MEGATRON  a megatron-core version to pin (e.g. 0.19.2); unset: whatever the `megatron` extra resolves to
#                   (already installed wins), i.e. the newest supported release for the interpreter.
#
# torch is pinned to 2.13.0: on Python 3.11 that is the CPU build lying on this machine's disk; elsewhere PyPI's
# (CUDA) build for Linux x86_64, ~1.45 GB plus its nvidia-* wheels (a Python 3.12 venv is ~5 GB), which imports and
# trains on a CPU-only host. Never an unpinned torch (a multi-GB download). To get the CPU build instead, install it
# first (`$VENV/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu`): the pin is then met
# by the torch already installed and pip keeps it.
#
# The install prints pip's progress (a line per package collected, downloaded and installed): a first run downloads for
# minutes.
#
# The install is skipped when nothing changed: a stamp in the venv holds a hash of pyproject.toml, the interpreter
# (`python -VV`), the clone's path (the editable install points there), the extras, the torch pin and the installed
# torch. When only the megatron-core pin differs from what is installed, only megatron-core is swapped (seconds).
TORCH_PIN="torch==2.13.0"

_ci_hash() {
  if command -v sha256sum >/dev/null 2>&1; then sha256sum | cut -c1-16; else shasum -a 256 | cut -c1-16; fi
}

# version of an installed distribution in the venv, "-" if absent
_installed() {
  "$PY" -c 'import sys, importlib.metadata as m
try:
    print(m.version(sys.argv[1]))
except m.PackageNotFoundError:
    print("-")' "$1"
}

# the stamp's key (megatron-core is checked apart, see ensure_venv)
_install_key() {
  { cat pyproject.toml; "$PY" -VV; pwd; echo "$1 $TORCH_PIN"; _installed torch; } | _ci_hash
}

ensure_venv() {
  local extras="$1" megatron_pin="" key stamp mcore
  if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
  if [ -n "${SLIME_EXT_MEGATRON:-}" ]; then
    megatron_pin="megatron-core==${SLIME_EXT_MEGATRON}"
  fi
  stamp="$VENV/.slime-ext-stamp-${extras//,/-}"
  key=$(_install_key "$extras")
  mcore=$(_installed megatron-core)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ "$mcore" != "-" ]; then
    if [ -z "$megatron_pin" ] || [ "$mcore" = "${SLIME_EXT_MEGATRON}" ]; then
      echo "ci: $VENV is up to date for [$extras] (stamp $key, megatron-core $mcore); no install"
    else
      echo "ci: $VENV is up to date for [$extras] (stamp $key); megatron-core $mcore -> ${SLIME_EXT_MEGATRON}"
      "$PY" -m pip install -q --disable-pip-version-check "$megatron_pin"
    fi
    return 0
  fi
  rm -f "$stamp"
  echo "ci: installing into $VENV: $TORCH_PIN${megatron_pin:+ $megatron_pin} and slime-ext[$extras] (editable)"
  echo "ci: torch installed now: $(_installed torch) (- = none; PyPI's CUDA build downloads ~1.45 GB)"
  "$PY" -m pip install -q --disable-pip-version-check --upgrade pip
  # shellcheck disable=SC2086
  "$PY" -m pip install --disable-pip-version-check --progress-bar off "$TORCH_PIN" $megatron_pin -e ".[$extras]"
  echo "ci: installed torch $(_installed torch), megatron-core $(_installed megatron-core)"
  _install_key "$extras" > "$stamp"
}

# One line naming what is tested: python, torch, and the megatron-core that is actually imported (its
# package_info, which a source checkout on PYTHONPATH reports too) with the place it comes from.
print_versions() {
  "$PY" -W ignore - <<'EOF2'
import platform, torch
try:
    from megatron.core import package_info
    import megatron.core
    mcore = f"megatron-core {package_info.__version__} ({megatron.core.__path__[0]})"
except ImportError as exc:
    mcore = f"megatron-core not importable ({exc})"
print(f"ci: python {platform.python_version()}, torch {torch.__version__}, {mcore}")
EOF2
}
