"""Host tests against real verl (github.com/verl-project/verl), on CPU: ``ci/verl_test`` runs them in their own venv
with verl from PyPI, or (``VERL_GIT=/path/to/verl/.git``) with verl's HEAD extracted from a clone and put first on
``PYTHONPATH``. Nothing of verl is copied into this repository; its code runs here."""

from __future__ import annotations

import pytest

HOW = 'run ci/verl_test (its venv has verl from PyPI), or pip install "./slime-ext[verl]" from a clone of slime-ext'


def _verl_missing() -> str | None:
    """Why verl cannot be tested here, or ``None``. (This folder is on ``sys.path``'s parent when pytest collects
    ``tests/``, so without verl installed ``import verl`` finds this folder as a namespace package: a real verl has a
    version.)"""
    try:
        import verl
    except ImportError as exc:
        return str(exc)
    if not isinstance(getattr(verl, "__version__", None), str):
        return f"'verl' resolves to {list(getattr(verl, '__path__', []))}, not an installed verl"
    return None


def pytest_collection_modifyitems(config, items):
    missing = _verl_missing()
    if missing is not None:
        skip = pytest.mark.skip(reason=f"verl is not importable ({missing}): {HOW}")
        for item in items:
            if "tests/verl" in str(item.fspath):
                item.add_marker(skip)
