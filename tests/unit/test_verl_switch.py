"""The verl switch without verl: the entry point slime-ext declares, and what the plugin does on `import verl` for
each value of SLIME_EXT_VERL (it only arranges patches for modules not imported yet; verl's own are tested in
tests/verl)."""

import importlib
import logging
import sys
from pathlib import Path

import pytest

import slime_ext.integrations.verl as sv
from slime_ext.patches import on_import
from slime_ext.patches.verl_host import MODULE, TRAINER_MODULE

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml with tomllib")



@pytest.fixture(autouse=True)
def verl_not_imported(monkeypatch):
    """Each case sees a process where verl's target modules are not imported yet (the plugin's situation when verl
    loads it), whatever an earlier test imported: they are hidden from ``sys.modules`` and put back afterwards."""
    for module in (MODULE, TRAINER_MODULE):
        monkeypatch.delitem(sys.modules, module, raising=False)


def _finders():
    return [f for f in sys.meta_path if isinstance(f, on_import.OnImport) and f.owner == sv.HOOK_OWNER]


@pytest.fixture
def load_plugin(monkeypatch):
    def load(value):
        if value is None:
            monkeypatch.delenv(sv.ENV, raising=False)
        else:
            monkeypatch.setenv(sv.ENV, value)
        import slime_ext.integrations.verl.plugin as plugin

        importlib.reload(plugin)  # verl loads it once per process; each case is a fresh process here
    yield load
    sv.disable()
    assert not _finders()


def test_pyproject_declares_the_verl_plugin_and_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["verl.plugins"] == {"slime_ext": "slime_ext.integrations.verl.plugin"}
    assert any(r.startswith("verl>=0.9.0") and "<0.11" in r for r in project["optional-dependencies"]["verl"])


@pytest.mark.parametrize("value", [None, "", "0", "off"])
def test_switch_off_arranges_nothing(load_plugin, value):
    load_plugin(value)
    assert not _finders()


@pytest.mark.parametrize("value,parts", [("1", {MODULE: "engine"}),
                                         ("trainer", {MODULE: "engine", TRAINER_MODULE: "trainer"})])
def test_switch_on_patches_verl_modules_when_they_are_imported(load_plugin, monkeypatch, value, parts):
    load_plugin(value)
    (finder,) = _finders()
    assert set(finder.actions) == set(parts)
    applied = []
    monkeypatch.setattr(sv, "_apply", applied.append)
    for module in parts:
        finder.actions[module](None)  # what the hook runs once verl's module has executed
    assert applied == list(parts.values())


def test_bad_value_is_logged_and_deferred_to_the_engine_import(load_plugin, caplog):
    with caplog.at_level(logging.ERROR, logger="slime_ext.integrations.verl"):
        load_plugin("maybe")
    (finder,) = _finders()
    assert set(finder.actions) == {MODULE}
    with pytest.raises(ValueError, match="SLIME_EXT_VERL='maybe'"):
        finder.actions[MODULE](None)
    assert "set SLIME_EXT_VERL=1" in caplog.text


def test_unknown_depth_is_refused():
    with pytest.raises(ValueError, match="depth='deep' is not one of"):
        sv.enable("deep")
