"""What `pip install slime-ext` puts on a machine: the built wheel's files and its metadata.

The wheel is built from this checkout with the interpreter's setuptools (offline, no build isolation) and read as a
zip: only ``slime_ext`` is a top-level package (the patches live in ``slime_ext.patches``, there is no top-level
``patches`` to shadow someone else's), the licence is an SPDX expression, and the extras keep megatron-core out of
``train`` (the host brings its Megatron) and in ``megatron``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: what the wheel is built from (ci/build_wheelhouse copies the same)
SOURCES = ("pyproject.toml", "README.md", "slime_ext")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # built from a private copy of what the wheel is made of (as ci/build_wheelhouse does): setuptools writes build/
    # and *.egg-info into the source folder, which a concurrent build of the checkout would share
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the build itself must not print setuptools' deprecation walls (e.g. a table-form license)
    assert "Deprecat" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    (path,) = out.glob("slime_ext-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def _metadata(wheel: zipfile.ZipFile):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return Parser().parsestr(wheel.read(name).decode())


def test_only_slime_ext_is_a_top_level_package(wheel):
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"slime_ext"}, top
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["slime_ext"]
    assert {"slime_ext/patches/__init__.py", "slime_ext/patches/megatron_cpu.py"} <= set(names)
    assert not any(n.startswith("patches/") for n in names)


def test_license_is_spdx_and_extras_leave_megatron_to_the_host(wheel):
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0"
    requires = meta.get_all("Requires-Dist")
    by_extra: dict[str, list[str]] = {}
    for req in requires:
        spec, _, marker = req.partition(";")
        extra = marker.split("extra ==")[-1].strip().strip("\"'") if "extra ==" in marker else ""
        by_extra.setdefault(extra, []).append(spec.strip())
    assert not any(r.startswith("megatron") for r in by_extra["train"]), by_extra["train"]
    assert any(r.startswith("packaging") for r in by_extra["train"])  # slime_ext.patches imports it
    (mcore,) = by_extra["megatron"]
    assert mcore.startswith("megatron-core") and ">=0.16.0rc0" in mcore and "<0.20" in mcore, mcore


def test_the_installed_package_has_no_top_level_patches():
    import importlib.util

    assert importlib.util.find_spec("slime_ext.patches") is not None
    spec = importlib.util.find_spec("patches")
    assert spec is None, f"a top-level 'patches' package is importable from {spec.origin}"
