"""How every bench runs and prints, so that a newcomer reads one bench and knows them all.

* :func:`parser` -- the command line: its description is the first paragraph of the bench's docstring, ``--quick``
  is the smoke run the tests use (seconds, no upstream code needed);
* :func:`add_planner_fields` / :func:`planner_config` -- ``--set NAME=VALUE``: any ``PlannerConfig`` field, so a
  sweep never needs an edit;
* :func:`target` -- one line per target: the verdict (:func:`bench.verdict.verdict`: PASS or FAIL over the cases it
  measured, SKIP and why over none) and what was checked;
* :func:`markdown_table` -- a table as markdown lines, the form the docs quote.

Each bench's ``main(argv)`` returns its exit status: 0, or 1 where ``--strict`` (or a check) says a target failed.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from .verdict import verdict


def parser(doc: str, *, prog: str | None = None, quick: str | None = None) -> argparse.ArgumentParser:
    """An argument parser described by ``doc``'s first paragraph; with ``quick``, the ``--quick`` flag and its help
    (what the smoke run covers)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    if quick is not None:
        p.add_argument("--quick", action="store_true", help=quick)
    return p


def add_planner_fields(p: argparse.ArgumentParser, what: str = "this run's planner") -> None:
    """``--set SECTION.FIELD=VALUE`` (repeatable, into ``args.overrides``): a ``PlannerConfig`` field for ``what``
    (:meth:`~slime_ext.schedule.PlannerConfig.replace_from`)."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help=f"a PlannerConfig field for {what}, e.g. refinement.refine_moves=128; repeatable")


def planner_config(overrides: Sequence[str]):
    """The ``PlannerConfig`` of ``--set`` overrides, or ``None`` (the planner's default) when there are none."""
    if not overrides:
        return None
    from slime_ext.schedule import PlannerConfig

    return PlannerConfig().replace_from(list(overrides))


def target(ok: bool, cases: int, why_none: str, text: str, *, markdown: bool = False) -> str:
    """``"  PASS (3 cases)  text"`` (``markdown``: ``"- PASS (3 cases) text"``): a target's verdict and what it
    checked; over zero cases a SKIP that says ``why_none``."""
    v = verdict(ok, cases, why_none)
    return f"- {v} {text}" if markdown else f"  {v}  {text}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """``header`` and ``rows`` as markdown table lines (cells formatted by the caller)."""
    if any(len(row) != len(header) for row in rows):
        raise ValueError(f"every row needs {len(header)} cells (the header's), got {sorted({len(r) for r in rows})}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
