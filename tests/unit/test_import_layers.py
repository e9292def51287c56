"""Imports run one way down (issue 22, item 5): no import cycle between modules, no import up the layers.

Every module of ``slime_ext`` and ``bench`` is parsed with :mod:`ast`, nothing is imported. Every ``import`` statement
counts wherever it stands: at module level, inside a function or method, under ``try:`` or ``if TYPE_CHECKING:``
(no exemption: an annotation-only import still ties the two modules, so it must point down too). Relative imports
are resolved against the importing module. ``from package import name`` is an edge to ``package.name`` when that is
a module, else to ``package`` (its ``__init__``). Importing ``a.b.c`` is not counted as importing ``a`` and ``a.b``
(Python runs their ``__init__`` first, but those edges are the packages' own, checked where they are written).
Modules loaded by a dotted path taken from a config (``importlib.import_module(config_value)``: the rollout function,
the train worker class) are the user's choice, not an edge of ours.

The layers are :data:`LAYERS`, bottom first: a module imports only from its own component and from layers below its
own; two components of one layer do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Mapping

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("slime_ext", "bench")

#: bottom first; a component is a module, a package (every module under it) or ``package.__init__`` (that file
#: alone). Where the modules outside the four layers of the style notes sit, and why:
LAYERS: tuple[tuple[str, ...], ...] = (
    # pure planning (stdlib + numpy); the package root (``__version__`` only); the patches, which change third-party
    # modules and import nothing of ours above them (what enters a host is handed to them)
    ("slime_ext.__init__", "slime_ext.schedule", "slime_ext.patches"),
    # the dp_schedule schemes, their records and the data iterator a scheme's training half builds; the one measure
    # that compares plans (metrics reads schedules only)
    ("slime_ext.schemes", "slime_ext.metrics"),
    # the training config (pure Python, shared by the training and rollout sides; it checks dp_schedule by scheme)
    ("slime_ext.train_config",),
    # the two adapters: megatron-core training and the rollout harness (which loads the train worker by dotted path)
    ("slime_ext.training", "slime_ext.rollout"),
    # what a user runs: the CLI, the slime and verl integrations, the harness entry point
    ("slime_ext.cli", "slime_ext.integrations", "slime_ext.run"),
    # the benchmarks, on top: they measure everything below, the integrations' plans included (bench.verl)
    ("bench",),
)


# ---------------------------------------------------------------------------------------------------- the graph
def find_modules(root: Path, packages: Iterable[str]) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is_package)}`` of every ``.py`` file under ``root/<package>``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join(parts)] = (path, is_package)
    return modules


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_edges(modules: Mapping[str, tuple[Path, bool]], roots: Iterable[str]
                 ) -> dict[str, dict[str, tuple[str, int]]]:
    """``{importer: {imported: (file, line)}}`` over the modules of ``roots`` (first place each edge is written)."""
    roots = tuple(roots)
    ours = lambda name: name.split(".")[0] in roots  # noqa: E731
    edges: dict[str, dict[str, tuple[str, int]]] = {m: {} for m in modules}
    for module, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if not ours(target):
                    continue
                assert target in modules, (f"{path.relative_to(ROOT) if ROOT in path.parents else path}:"
                                           f"{node.lineno}: {module} imports {target}, which is no module here")
                if target != module:
                    edges[module].setdefault(target, (path.name, node.lineno))
    return edges


def component(module: str, layers=LAYERS) -> tuple[int, str]:
    """``(layer index, component)`` of a module: the longest component that is the module or a package above it."""
    best = None
    for i, layer in enumerate(layers):
        for comp in layer:
            if comp.endswith(".__init__"):
                inside = module == comp[:-len(".__init__")]
            else:
                inside = module == comp or module.startswith(comp + ".")
            if inside and (best is None or len(comp) > len(best[1])):
                best = (i, comp)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return best


def upward_edges(edges, layers=LAYERS) -> list[str]:
    """Edges into the importer's own layer (another component) or above, as ``a -> b (file:line)``."""
    found = []
    for src, targets in sorted(edges.items()):
        (i, a) = component(src, layers)
        for dst, (file, line) in sorted(targets.items()):
            (j, b) = component(dst, layers)
            if a != b and j >= i:
                how = "up" if j > i else "sideways"
                found.append(f"{src} -> {dst} ({file}:{line}): {how}, layer {i} {a} -> layer {j} {b}")
    return found


def cycles(edges) -> list[str]:
    """One cycle per strongly connected group of modules, as ``a -> b (file:line) -> ... -> a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    found = []
    for group in groups:  # a shortest way back to the start, inside the group
        start = min(group)
        prev = {start: None}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in edges[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(edges[v]):
                    if w in group and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in edges[v])
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        path.reverse()
        path.append(start)
        hops = [f"{a} -> {b} ({edges[a][b][0]}:{edges[a][b][1]})" for a, b in zip(path, path[1:])]
        found.append(f"cycle of {len(group)} modules: " + ", ".join(hops))
    return sorted(found)


def the_graph():
    return import_edges(find_modules(ROOT, PACKAGES), PACKAGES)


# ---------------------------------------------------------------------------------------------------- the rules
def test_no_import_cycle_between_modules():
    found = cycles(the_graph())
    assert found == [], "import cycles (give the shared piece one home below both):\n  " + "\n  ".join(found)


def test_no_import_up_or_sideways_between_layers():
    found = upward_edges(the_graph())
    assert found == [], ("imports against the layers (move the shared piece down):\n  " + "\n  ".join(found))


def test_every_module_has_a_layer_and_the_graph_is_not_empty():
    edges = the_graph()
    for module in edges:
        component(module)
    # the checker sees imports inside functions and relative ones: a few edges the code is known to have
    assert "slime_ext" in edges["slime_ext.rollout.actors"]  # ``import slime_ext`` inside a method
    assert "slime_ext.schedule.config" in edges["slime_ext.schedule.compat"]  # relative: ``from .config import``
    assert "bench.pipeline_real" in edges["bench.pipeline"]  # inside main()


# ---------------------------------------------------------------------------------------------------- the checker
def _package(tmp_path: Path, files: Mapping[str, str]) -> dict[str, dict[str, tuple[str, int]]]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_edges(find_modules(tmp_path, ["pkg"]), ["pkg"])


TOY_LAYERS = (("pkg.low",), ("pkg.mid_a", "pkg.mid_b"), ("pkg.top",))


def test_the_checker_names_a_cycle_hidden_in_a_method_and_a_relative_import(tmp_path):
    edges = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "from .a import x\n",
        "pkg/low/a.py": "x = 1\ndef f():\n    from . import b\n",
        "pkg/low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low.a import x\n",
    })
    assert cycles(edges) == ["cycle of 2 modules: pkg.low.a -> pkg.low.b (a.py:3), pkg.low.b -> pkg.low.a (b.py:3)"]
    assert upward_edges(edges, (("pkg",),)) == []


def test_the_checker_names_upward_and_sideways_edges(tmp_path):
    edges = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "class C:\n    def m(self):\n        import pkg.top\n",
        "pkg/mid_a.py": "from . import low\nfrom .mid_b import y\n",
        "pkg/mid_b.py": "y = 2\n",
        "pkg/top.py": "from pkg import mid_a, low\n",
    })
    assert cycles(edges) == ["cycle of 3 modules: pkg.low -> pkg.top (low.py:3), pkg.top -> pkg.low (top.py:1)"]
    layers = TOY_LAYERS + (("pkg.__init__",),)
    assert upward_edges(edges, layers) == [
        "pkg.low -> pkg.top (low.py:3): up, layer 0 pkg.low -> layer 2 pkg.top",
        "pkg.mid_a -> pkg.mid_b (mid_a.py:2): sideways, layer 1 pkg.mid_a -> layer 1 pkg.mid_b",
    ]
    with pytest.raises(AssertionError, match="pkg.new is in no layer"):  # the root's __init__ covers no module
        component("pkg.new", layers)
