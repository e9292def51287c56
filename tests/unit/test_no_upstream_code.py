"""No upstream code in the tree: no function or class of upstream slime's scheduling modules is defined, imported or
called by its bare name anywhere in this repository.

Where a comparison needs upstream, it is imported at run time (:mod:`slime_ext.schemes.upstream`) and used as an
attribute of that module (``upstream.load().dp_schedule.build_dp_schedule``), which this test allows. The names come
from upstream's own files at every supported tag; :func:`test_the_list_is_upstreams` re-reads them there whenever a
slime clone is at hand (``SLIME_GIT``), so the list cannot go stale silently.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from slime_ext.schemes import upstream

REPO = Path(__file__).resolve().parents[2]
TAGS = ("v0.2.4", "v0.3.0", "v0.3.1", "HEAD")
FILES = ("slime/utils/seqlen_balancing.py", "slime/utils/dp_schedule.py", "slime/utils/flops_utils.py")
#: module-level functions and classes of FILES, at any of TAGS
UPSTREAM_NAMES = frozenset({
    # seqlen_balancing.py
    "karmarkar_karp", "greedy_partition", "get_seqlen_balanced_partitions", "get_reverse_idx", "first_fit_pack",
    "_split_bin_by_tokens", "expand_bins_by_splitting",
    # dp_schedule.py (v0.3.0 on)
    "_calculate_workloads", "_pack_step_into_mbs", "build_dp_schedule",
    # flops_utils.py
    "calculate_embedding_flops", "calculate_lm_head_flops", "_is_multi_latent_attention",
    "calculate_qkv_projection_flops", "calculate_attention_flops", "calculate_output_flops", "calculate_mlp_flops",
    "calculate_layer_flops", "calculate_fwd_flops",
})
#: the entry point slime calls keeps slime's name and signature on purpose: slime-ext's drop-ins for it
#: (``slime_ext.schedule.compat``, the slime integration and its patch) put our planner in upstream's place
CHECKED = UPSTREAM_NAMES - {"build_dp_schedule"}


def _top_level_names(source: str) -> set[str]:
    tree = ast.parse(source)
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_the_list_is_upstreams():
    git_dir = upstream.git_dir()
    if git_dir is None:
        pytest.skip(f"no slime clone to re-read the names from: {upstream.HOW}")
    found: set[str] = set()
    for tag in TAGS:
        for path in FILES:
            show = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{tag}:{path}"], capture_output=True,
                                  text=True)
            if show.returncode == 0:  # dp_schedule.py exists from v0.3.0 on
                found |= _top_level_names(show.stdout)
    assert found, f"none of {FILES} found at {TAGS} in {git_dir}"
    assert found <= UPSTREAM_NAMES, f"upstream has names this test does not check: {sorted(found - UPSTREAM_NAMES)}"


def _python_files(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=root,
                         capture_output=True, text=True, check=True).stdout.split()
    return [root / p for p in out if (root / p).is_file()]


def _uses(path: Path, root: Path) -> list[str]:
    """``file:line what`` for each definition, import or bare-name use of an upstream name in ``path``."""
    rel = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in CHECKED:
            found.append(f"{rel}:{node.lineno} defines {node.name}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.rsplit(".", 1)[-1] in CHECKED]
        elif isinstance(node, ast.Name) and node.id in CHECKED:
            found.append(f"{rel}:{node.lineno} uses {node.id}")
    return found


def test_no_upstream_function_is_defined_imported_or_called_here():
    files = _python_files(REPO)
    assert any(p.name == "planner.py" for p in files)  # the walk sees the tree
    found = [use for path in files for use in _uses(path, REPO)]
    assert found == [], "upstream code in the tree (import it at run time instead, slime_ext.schemes.upstream):\n" \
        + "\n".join(found)


def test_the_check_finds_a_copy(tmp_path):
    """The walk flags a definition, an import and a bare call, and lets an attribute of a loaded module pass."""
    bad = tmp_path / "copy.py"
    bad.write_text("from slime.utils.seqlen_balancing import first_fit_pack\n"
                   "def karmarkar_karp(x):\n    return first_fit_pack(x, 1)\n"
                   "def fine(up):\n    return up.seqlen_balancing.expand_bins_by_splitting\n")
    assert sorted(_uses(bad, tmp_path)) == ["copy.py:1 imports first_fit_pack", "copy.py:2 defines karmarkar_karp",
                                            "copy.py:3 uses first_fit_pack"]
