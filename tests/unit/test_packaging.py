"""What `pip install slime-ext` puts on a machine: the built wheel's files and its metadata.

The wheel is built from this checkout with the interpreter's setuptools (offline, no build isolation) and read as a
zip: only ``slime_ext`` is a top-level package (the patches live in ``slime_ext.patches``, there is no top-level
``patches`` to shadow someone else's), the licence is an SPDX expression, and the extras keep megatron-core out of
``train`` (the host brings its Megatron) and in ``megatron``. The wheel is then installed (offline, ``--no-deps
--target``) into a folder of its own and every entry point it declares (the console scripts, verl's
``verl.plugins`` entry) and every launcher (``python -m slime_ext.integrations.<host>``) is imported from there, in a
fresh interpreter, so a module left out of the wheel or a name that moved fails here, not on a user's machine.
"""

from __future__ import annotations

import configparser
import json
import os
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


#: every entry point the wheel declares, by group, and the extra that brings what it imports (the test interpreter
#: has train, megatron and rollout; the verl plugin must import without verl, as it does nothing until verl loads it)
ENTRY_POINTS = {
    "console_scripts": {"slime-ext": "slime_ext.cli:main", "slime-ext-run": "slime_ext.run:main"},
    "verl.plugins": {"slime_ext": "slime_ext.integrations.verl.plugin"},
}
#: the launchers a user runs with ``python -m`` (README's host table): module -> its entry function
LAUNCHERS = {
    "slime_ext.integrations.slime.__main__": "main",
    "slime_ext.integrations.megatron_rl.__main__": "main",
}


@pytest.fixture(scope="module")
def wheel_path(tmp_path_factory) -> Path:
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
    return path


@pytest.fixture(scope="module")
def wheel(wheel_path) -> zipfile.ZipFile:
    with zipfile.ZipFile(wheel_path) as zf:
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


def _entry_points(wheel: zipfile.ZipFile) -> dict[str, dict[str, str]]:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # keep the names' case
    parser.read_string(wheel.read(name).decode())
    return {group: dict(parser[group]) for group in parser.sections()}


def test_the_wheel_declares_the_entry_points_the_docs_name(wheel):
    assert _entry_points(wheel) == ENTRY_POINTS


def test_every_entry_point_and_launcher_imports_from_the_installed_wheel(wheel_path, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                           "--disable-pip-version-check", "-q", "--target", str(target), str(wheel_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    targets = [value for group in ENTRY_POINTS.values() for value in group.values()]
    targets += [f"{module}:{attr}" for module, attr in LAUNCHERS.items()]
    # a fresh interpreter, run outside the checkout, with the installed wheel first on the path: each target's module
    # must come from the wheel (not from the checkout or an editable install), and its attribute must exist
    script = """
import importlib, json, sys
found = {}
for target in sys.argv[1:]:
    module, _, attr = target.partition(":")
    mod = importlib.import_module(module)
    obj = getattr(mod, attr) if attr else mod
    found[target] = [mod.__file__, callable(obj) or not attr]
print(json.dumps(found))
"""
    env = {**os.environ, "PYTHONPATH": str(target)}
    env.pop("SLIME_EXT_VERL", None)  # the plugin's switch off: importing it must patch nothing
    proc = subprocess.run([sys.executable, "-c", script, *targets], capture_output=True, text=True, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(found) == sorted(targets)
    for target_name, (path, is_callable) in found.items():
        assert Path(path).resolve().is_relative_to(target.resolve()), (target_name, path)
        assert is_callable, f"{target_name} is not callable"


@pytest.mark.parametrize("script", sorted(ENTRY_POINTS["console_scripts"]))
def test_each_console_script_answers_help(script):
    module, _, attr = ENTRY_POINTS["console_scripts"][script].partition(":")
    call = f"import sys; from {module} import {attr}; sys.exit({attr}(['--help']))"
    proc = subprocess.run([sys.executable, "-c", call], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "usage:" in proc.stdout.lower(), proc.stdout
