"""``upstream.extract`` is shared by processes (pytest-xdist workers, training ranks): they take turns, one
extracts, the others find the tree complete; a half-extracted tree is redone."""

from __future__ import annotations

import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from slime_ext.schemes import upstream

FILES = {f"pkg/m{i}.py": f"VALUE = {i}\n" * 200 for i in range(40)}


def _repo(tmp_path: Path) -> tuple[str, str]:
    work = tmp_path / "repo"
    for name, text in FILES.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "files"], check=True)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    return str(work / ".git"), commit


def _extract_and_read(git_dir: str, commit: str, dest: str) -> dict[str, str]:
    root = upstream.extract(git_dir, commit, Path(dest))
    return {name: (root / name).read_text() for name in FILES}


def test_processes_sharing_a_tree_each_see_it_whole(tmp_path):
    git_dir, commit = _repo(tmp_path)
    dest = tmp_path / "cache" / "tree"
    with ProcessPoolExecutor(4) as pool:
        seen = list(pool.map(_extract_and_read, [git_dir] * 8, [commit] * 8, [str(dest)] * 8))
    assert len(seen) == 8 and all(s == FILES for s in seen)
    assert (dest / ".complete").read_text() == commit


def test_a_half_extracted_tree_is_redone(tmp_path):
    git_dir, commit = _repo(tmp_path)
    dest = tmp_path / "tree"
    (dest / "pkg").mkdir(parents=True)
    (dest / "pkg" / "m0.py").write_text("TRUNCATED")  # a killed run's leftovers, no .complete marker
    (dest / "stale.py").write_text("")
    assert _extract_and_read(git_dir, commit, str(dest)) == FILES
    assert not (dest / "stale.py").exists()
