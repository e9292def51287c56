"""Rules of ``slime_ext/schedule``'s code that a reviewer would otherwise have to check by eye: functions short
enough to read in one screen, and no tuned number written inline in the pipeline search (every threshold, share or
tolerance is a documented ``PlannerConfig`` field)."""

from __future__ import annotations

import ast
from pathlib import Path

import slime_ext.schedule as schedule

ROOT = Path(schedule.__file__).parent

#: the longest a function of the planning layer may be (lines, its docstring and decorators included)
MAX_FUNCTION_LINES = 80
#: functions allowed over the limit while they are being split (a name here that is no longer too long fails the
#: test, so the list only shrinks); empty: every function of the planning layer is within it
KNOWN_LONG: set[str] = set()
#: float literals the pipeline modules may write inline: identities and halves, never a tuned value
PLAIN_FLOATS = {0.0, 0.5, 1.0, 2.0}


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, node.end_lineno - start + 1


def long_functions(root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{"module.py:name": lines}`` of every function of ``root``'s modules over ``limit`` lines."""
    return {f"{path.relative_to(root)}:{name}": n for path in sorted(root.rglob("*.py"))
            for name, n in _functions(path) if n > limit}


def inline_floats(paths) -> list[str]:
    """``"module.py:line value"`` of every float literal in ``paths`` other than :data:`PLAIN_FLOATS`."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and type(node.value) is float and node.value not in PLAIN_FLOATS:
                out.append(f"{path.name}:{node.lineno} {node.value!r}")
    return out


def test_no_function_in_the_planning_layer_is_over_80_lines():
    found = long_functions()
    assert set(found) - KNOWN_LONG == set(), f"split these functions (lines): {found}"
    assert KNOWN_LONG <= set(found), f"no longer too long, drop from KNOWN_LONG: {sorted(KNOWN_LONG - set(found))}"


def test_no_tuned_float_is_written_inline_in_the_pipeline_search():
    paths = sorted(ROOT.glob("pipeline*.py")) + sorted(ROOT.glob("pipeline/*.py"))
    assert paths
    assert inline_floats(paths) == [], "make these PlannerConfig fields"


def test_the_checks_find_what_they_look_for(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("def f():\n" + "    x = 1\n" * 81 + "\ndef g():\n    return 0.25 * 2.0 + 0.5\n")
    assert long_functions(tmp_path) == {"m.py:f": 82}
    assert inline_floats([code]) == ["m.py:85 0.25"]
