"""The examples in README.md and docs/*.md run as tests, through Sybil (https://sybil.readthedocs.io).

Two kinds of fenced block are run; every other block (``bash``, plain output, ...) is text only:

* ``python`` blocks: executed in order, one namespace per file; a block of ``>>>`` lines is a doctest (ELLIPSIS on).
* ``console`` blocks: ``$ command`` lines (a line ending in ``\\`` continues), each followed by the output it must
  print. A block's commands run in one bash process at the repository root (a variable set by one is seen by the
  next), stdout and stderr together, with ``slime-ext`` and ``python`` meaning this interpreter and this checkout.
  The output is compared line by line after the masks below (times that depend on the machine), with ``...``
  matching any text, as doctest's ELLIPSIS does, so an example may show only the lines it talks about.

Each document with examples is one test (``README.md::examples``), its examples evaluated in order by Sybil. An
example that needs what CI does not have (Ray's cluster, a GPU, a fetched slime or Megatron-LM checkout) is marked
in the markdown with ``<!-- skip: next "the reason" -->``, its text says it is not run, and the test's report lists
it. How to regenerate an example whose output changed: docs/contributing.md.
"""

from __future__ import annotations

import doctest
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import pytest

try:
    from sybil import Sybil
    from sybil.example import SybilFailure
    from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser
except ImportError as exc:  # the other tests still run; each document fails, saying why (never a silent pass)
    _SYBIL_MISSING: ImportError | None = exc
else:
    _SYBIL_MISSING = None

ROOT = Path(__file__).resolve().parent

#: machine-dependent parts of the CLI's output, replaced in both the expected and the printed text before comparing:
#: wall-clock planning times. Everything else (plans, FLOPs, model-predicted step times) is deterministic and compared.
MASKS = [
    (re.compile(r"planned in [0-9.]+ ms"), "planned in <time> ms"),
]

#: documents that must hold examples: a page whose examples were all turned into plain text would otherwise pass
#: by having no test at all
MUST_HAVE_EXAMPLES = ("README.md", "docs/cli.md", "docs/planner.md")

_CHECKER = doctest.OutputChecker()
_PROMPT = "$ "


def _commands(source: str) -> list[tuple[str, str]]:
    """``(command, expected output)`` pairs of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    continued = False
    for line in source.splitlines():
        if continued:
            pairs[-1] = (pairs[-1][0] + "\n" + line, pairs[-1][1])
            continued = line.endswith("\\")
        elif line.startswith(_PROMPT):
            pairs.append((line[len(_PROMPT):], []))
            continued = line.endswith("\\")
        elif pairs:
            pairs[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"a console block must start with '{_PROMPT}command', not {line!r}")
    return [(command, "\n".join(out)) for command, out in pairs]


def _normalise(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()) + "\n"


def _shims(tmp: Path) -> Path:
    """``slime-ext`` and ``python`` for this interpreter: the checkout under test, installed or not."""
    shims = tmp / "doc-shims"
    if not shims.exists():
        shims.mkdir()
        for name, args in (("slime-ext", "-m slime_ext.cli"), ("python", "")):
            path = shims / name
            path.write_text(f'#!/bin/sh\nexec "{sys.executable}" {args} "$@"\n')
            path.chmod(0o755)
    return shims


_BOUNDARY = "@@slime-ext-doc-example-boundary@@"


def evaluate_console(example) -> str | None:
    """Run a console block's commands in one bash process (so ``$ M=...`` sets a variable the next command uses),
    each command's stdout and stderr together, and compare each command's output with the document's."""
    pairs = _commands(example.parsed)
    script = "".join(f"{{ {command}\n}} 2>&1\necho; echo {_BOUNDARY}\n" for command, _ in pairs)
    env = {**os.environ, "PATH": f"{_shims(Path(example.namespace['_docs_tmp']))}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=300)
    outputs = proc.stdout.split(_BOUNDARY + "\n")
    if len(outputs) != len(pairs) + 1:  # every command reached its boundary, and nothing printed after the last
        return f"the block's commands stopped early (exit code {proc.returncode}):\n{proc.stdout}"
    for (command, expected), printed in zip(pairs, outputs):
        want, got = _normalise(expected), _normalise(printed)
        if not _CHECKER.check_output(want, got, doctest.ELLIPSIS):
            return f"\n$ {command}\nprinted, after the masks:\n{got}\nthe document expects:\n{want}"
    return None


def _setup(namespace: dict) -> None:
    namespace["_docs_tmp"] = tempfile.mkdtemp(prefix="slime-ext-docs-")


def _teardown(namespace: dict) -> None:
    shutil.rmtree(namespace["_docs_tmp"], ignore_errors=True)


class DocumentExamples(pytest.Item):
    """One test per document: its examples evaluated in order, in one namespace. (Sybil's own pytest integration makes
    one test per example; under pytest-xdist or a random test order those would run apart from the examples that
    set up their namespace.) An example marked ``skip`` is listed in the report, not run."""

    def __init__(self, *, sybil, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sybil = sybil

    def runtest(self) -> None:
        document = self.sybil.parse(self.path)
        _setup(document.namespace)
        not_run = []
        try:
            for example in document.examples():
                try:
                    example.evaluate()
                except unittest.SkipTest as exc:
                    not_run.append(f"line {example.line}: {exc}")
        finally:
            _teardown(document.namespace)
        if not_run:
            self.add_report_section("call", "examples not run", "\n".join(not_run))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, SybilFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, 0, f"{self.path.name}: its examples"


class DocumentFile(pytest.File):
    def collect(self):
        if _SYBIL_MISSING is not None:
            pytest.fail(f"the documentation's examples need Sybil ({_SYBIL_MISSING}): "
                        "pip install -e '.[test]' (ci/test installs it)", pytrace=False)
        if any(True for _ in _SYBIL.parse(self.path).examples()):
            yield DocumentExamples.from_parent(self, name="examples", sybil=_SYBIL)
        elif self.path.relative_to(ROOT).as_posix() in MUST_HAVE_EXAMPLES:
            pytest.fail(f"{self.path.name} has no example that runs (python or console blocks); "
                        "see docs/contributing.md", pytrace=False)
        # any other page without examples is no test


def _is_document(path: Path) -> bool:
    return path.suffix == ".md" and (path == ROOT / "README.md" or path.parent == ROOT / "docs")


def pytest_collect_file(file_path: Path, parent):
    return DocumentFile.from_parent(parent, path=file_path) if _is_document(file_path) else None


_SYBIL = None if _SYBIL_MISSING is not None else Sybil(
    parsers=[
        SkipParser(),
        PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS),
        CodeBlockParser(language="console", evaluator=evaluate_console),
    ],
)
