"""No benchmark prints PASS over nothing: every target goes through :func:`bench.verdict.verdict`, which names its
cases, and prints SKIP with the reason where there are none (e.g. no upstream slime for the reference)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.verdict import PASS_OVER_CASES, unfounded, verdict

REPO = Path(__file__).resolve().parents[2]
#: the quick modes that run in seconds without upstream code (bench.pipeline and bench.pipeline_stages replay
#: megatron-core's schedule for tens of seconds: their e2e tests apply the same check to their output)
QUICK_MODES = [
    ["bench.run", "--quick", "--repeats", "1"],
    ["bench.pipeline_speed", "--quick", "--repeats", "1"],
    ["bench.pipeline_search", "--quick"],
    ["bench.log_probs", "--quick"],
]


def test_verdict_is_skip_over_zero_cases_and_names_its_cases_otherwise():
    assert verdict(True, 0, "no upstream slime") == "SKIP (no cases: no upstream slime)"
    assert verdict(False, 0, "x") == "SKIP (no cases: x)"
    assert verdict(True, 1, "") == "PASS (1 case)" and verdict(True, 12, "") == "PASS (12 cases)"
    assert verdict(False, 3, "") == "FAIL (3 cases)"
    with pytest.raises(ValueError, match="cases=-1"):
        verdict(True, -1, "")
    old = "  PASS  FLOPs max/mean <= reference (b) on every case and flags: 0/0"  # before bench.verdict
    assert unfounded(f"x\n{old}\n  SKIP  y\n  PASS (2 cases)  z\n  SKIP (no cases: no slime)  w") == [old, "  SKIP  y"]


def test_no_bench_writes_pass_but_the_verdict():
    """A string literal holding PASS anywhere in bench/ outside bench/verdict.py (docstrings aside) is a verdict
    that bypasses the zero-case rule."""
    found = []
    for path in sorted((REPO / "bench").glob("*.py")):
        if path.name == "verdict.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "PASS" in node.value \
                    and id(node) not in docstrings:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"PASS written outside bench.verdict.verdict: {found}"


@pytest.mark.parametrize("argv", QUICK_MODES, ids=[a[0] for a in QUICK_MODES])
def test_quick_modes_without_upstream_print_no_pass_over_nothing(argv):
    env = {k: v for k, v in os.environ.items() if k not in ("SLIME_GIT", "MEGATRON_LM_GIT", "MEGATRON_LM_TREE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert unfounded(res.stdout) == []
    assert PASS_OVER_CASES.search(res.stdout) or "SKIP" in res.stdout, res.stdout[-2000:]
    # the reference needs upstream slime: without it, its comparison is skipped, saying why
    if argv[0] == "bench.run" and importlib.util.find_spec("slime") is None:
        line = next(ln for ln in res.stdout.splitlines() if "FLOPs max/mean <= reference (b)" in ln)
        assert "SKIP (no cases: upstream slime is not available" in line, line


def test_runner_prints_targets_and_tables_one_way():
    from bench.runner import markdown_table, parser, planner_config, target

    assert target(True, 2, "x", "fast enough") == "  PASS (2 cases)  fast enough"
    assert target(True, 0, "no GPU", "fast enough", markdown=True) == "- SKIP (no cases: no GPU) fast enough"
    assert markdown_table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        markdown_table(["a", "b"], [[1]])
    args = parser("One line.\n\nMore.", quick="small").parse_args(["--quick"])
    assert args.quick
    assert planner_config([]) is None


def test_every_bench_the_docs_and_ci_name_exists():
    """``python -m bench.X`` and ``bench/X.py`` in the README, docs/, ci/ and bench/ name a module that is there (a
    bench removed or moved takes its mentions with it)."""
    named = set()
    texts = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(p for p in (REPO / "ci").rglob("*") if p.is_file()),
             REPO / ".ci" / "run", *(REPO / "bench").glob("*.py")]
    for path in texts:
        if path.suffix in ("", ".md", ".py", ".sh") and path.exists():
            text = path.read_text(errors="replace")
            named |= {(path.name, m) for m in re.findall(r"\bbench[./]([a-z_]+)\b(?!\.json)", text)}
    assert len(named) > 20, named  # the scan reads the places it names
    missing = sorted((where, m) for where, m in named if not (REPO / "bench" / f"{m}.py").exists()
                     and m not in ("md", "py"))
    assert not missing, f"named but not in bench/: {missing}"
