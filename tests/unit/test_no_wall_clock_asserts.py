"""No test compares a measured duration with a bound: tests assert order and outcome, not seconds.

A wall-clock bound fails on a busy machine (a laptop running ``ci/test`` beside a build, a CI worker beside
another job) while the code is right. Where speed is the point (a fault surfaces before a timeout), the test sets
the deadline the slow path would run into as the code's own argument and asserts which outcome came (see
``tests/e2e/test_rollout_faults.py``).

This scans every test file under ``tests/`` with :mod:`ast` and fails naming ``file:line`` for an ``assert`` that
bounds a measured duration from above (``elapsed() < 30``, ``took < TIMEOUT + 5``, ``0 < seconds < 60``,
``abs(predicted / measured - 1) < 0.1``). A duration is:

* a clock call (``time.time()``, ``perf_counter()``, ``monotonic()``, ``process_time()``, ``thread_time()``,
  their ``_ns`` forms), or a call of a function of the same file that returns one;
* a call of the name a ``with ...timer...() as NAME`` binds;
* a name assigned from one of these;
* a name, attribute or string key that says it is one (``seconds``, ``elapsed``, ``took``, ``duration``,
  ``time``, ``wall_s``, ``measured``, ``"measured s"``);
* a field of a profile of measured timings (a name assigned ``CostProfile.load(...)``).

A bound is an expression that is not a duration and holds a number or an UPPER_CASE constant. Lower bounds
(``seconds > 0``, ``elapsed() >= grace``) pass: a busy machine only makes things slower.

A legitimate exception (none today) is marked on the assert's line with ``# wall-clock: <why>``, e.g. a test of
a timer's own arithmetic on scripted, not measured, durations.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
CLOCKS = {"time", "perf_counter", "monotonic", "process_time", "thread_time"}
CLOCKS |= {f"{name}_ns" for name in CLOCKS}
DURATION_WORDS = re.compile(r"(^|_)(seconds|secs|elapsed|took|duration|time|wall_s|measured)($|_)|^measured s$")
#: calls whose result is a profile of measured timings (``slime-ext calibrate``'s output): its fields are durations
MEASURED_LOADS = {("CostProfile", "load")}
MARKER = "# wall-clock:"


def _name_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    return None


def _is_clock_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _name_of(node.func) in CLOCKS and not node.args and \
        (isinstance(node.func, ast.Name) or _name_of(getattr(node.func, "value", None)) == "time")


class _Durations:
    """What counts as a measured duration in one file (see the module docstring)."""

    def __init__(self, tree: ast.Module):
        self.timers: set[str] = set()  # names bound by `with timer() as NAME`: NAME() is a duration
        self.functions: set[str] = set()  # functions of this file that return a clock reading
        self.names: set[str] = set()  # names assigned from a duration
        self.profiles: set[str] = set()  # names assigned a measured profile: their attributes are durations
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                    and isinstance(node.value.func, ast.Attribute) \
                    and (_name_of(node.value.func.value), node.value.func.attr) in MEASURED_LOADS:
                self.profiles |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name) \
                    and isinstance(node.context_expr, ast.Call) \
                    and "timer" in (_name_of(node.context_expr.func) or "").lower():
                self.timers.add(node.optional_vars.id)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                returns = [n.value for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
                if any(self._measured(r) for r in returns):
                    self.functions.add(node.name)
        changed = True
        while changed:  # names assigned from durations, until nothing new
            changed = False
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None \
                        and self._measured(node.value):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for target in targets:
                        for name in ast.walk(target):
                            if isinstance(name, ast.Name) and name.id not in self.names:
                                self.names.add(name.id)
                                changed = True

    def _measured(self, expr: ast.AST) -> bool:
        """Holds a clock reading (a clock call, a timer, a function returning one, a name assigned one)."""
        for node in ast.walk(expr):
            if _is_clock_call(node):
                return True
            if isinstance(node, ast.Call) and _name_of(node.func) in (self.timers | self.functions):
                return True
            if isinstance(node, ast.Name) and node.id in self.names:
                return True
        return False

    def duration(self, expr: ast.AST) -> bool:
        if self._measured(expr):
            return True
        if any(isinstance(node, ast.Attribute) and _name_of(node.value) in self.profiles for node in ast.walk(expr)):
            return True
        return any(DURATION_WORDS.search(name) for node in ast.walk(expr) if (name := _name_of(node)))

    def bound(self, expr: ast.AST) -> bool:
        if self.duration(expr):
            return False
        for node in ast.walk(expr):
            if isinstance(node, ast.Constant) and type(node.value) in (int, float):
                return True
            if isinstance(node, ast.Name) and node.id.isupper():
                return True
        return False


def wall_clock_asserts(path: Path) -> list[str]:
    """``file:line: source`` of every assert in ``path`` that bounds a measured duration from above."""
    text = path.read_text()
    tree = ast.parse(text, str(path))
    lines = text.splitlines()
    durations = _Durations(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            operands = [compare.left, *compare.comparators]
            for left, op, right in zip(operands, compare.ops, operands[1:]):
                upper = (isinstance(op, (ast.Lt, ast.LtE)) and durations.duration(left) and durations.bound(right)) \
                    or (isinstance(op, (ast.Gt, ast.GtE)) and durations.duration(right) and durations.bound(left))
                line = lines[compare.lineno - 1]
                if upper and MARKER not in line:
                    found.append(f"{path.relative_to(REPO)}:{compare.lineno}: {line.strip()}")
    return found


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_test_bounds_a_measured_duration():
    found = [hit for path in _test_files() for hit in wall_clock_asserts(path)]
    assert not found, ("assert order and outcome, not seconds (see this module's docstring; a legitimate "
                       "exception is marked '# wall-clock: <why>' on its line):\n  " + "\n  ".join(found))


def _hits(source: str, tmp_path: Path) -> list[int]:
    path = tmp_path / "test_sample.py"
    path.write_text(source)
    return [int(hit.split(":")[1]) for hit in wall_clock_asserts(path)]


def test_the_check_finds_the_forms_it_names(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    source = '''\
import time
from rollout_harness import timer
TIMEOUT_S = 5

def since(t0):
    return time.monotonic() - t0

def test_x(result, r, rows):
    with timer() as elapsed:
        pass
    assert elapsed() < 30
    start = time.perf_counter()
    took = time.perf_counter() - start
    assert took < TIMEOUT_S + 15
    assert result["seconds"] < TIMEOUT_S + 15
    predicted, measured = float(r["predicted s"]), float(r["measured s"])
    assert 0 < measured < 60 and abs(predicted / measured - 1) < 0.10
    assert 90 > since(start)
    assert measured > 0 and elapsed() >= 2 and took >= TIMEOUT_S
    assert rows.units == "seconds" and predicted < 60
    assert prof.microbatch_time([256]) > prof.microbatch_time([32])
    assert elapsed() < 30  # wall-clock: a scripted duration, not a measured one
    prof = CostProfile.load("profile.json")
    assert 0.5 < prof.backward_forward_ratio < 8 and prof.p2p_s > 0
    assert step.step_time <= 2.5
'''
    assert _hits(source, tmp_path) == [11, 14, 15, 17, 17, 18, 24, 25]
