"""Host tests against real verl (github.com/verl-project/verl), on CPU: ``ci/verl_test`` runs them in their own venv
with verl from PyPI, or (``VERL_GIT=/path/to/verl/.git``) with verl's HEAD extracted from a clone and put first on
``PYTHONPATH``. Nothing of verl is copied into this repository; its code runs here."""

from __future__ import annotations

import pytest

HOW = "run ci/verl_test (its venv has verl from PyPI), or pip install 'slime-ext[verl]'"


def pytest_collection_modifyitems(config, items):
    try:
        import verl  # noqa: F401
    except ImportError as exc:
        skip = pytest.mark.skip(reason=f"verl is not importable ({exc}): {HOW}")
        for item in items:
            if "tests/verl" in str(item.fspath):
                item.add_marker(skip)
