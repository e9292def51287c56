"""Start the processes of a gloo test of verl (tests/verl)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(script: str, world: int, tmp_path: Path, env: dict[str, str] | None = None, timeout: int = 300,
              extra: tuple[str, ...] = ()) -> list[subprocess.CompletedProcess]:
    """Start ``world`` processes of ``tests/verl/<script>`` (gloo over a file store) and wait for them all."""
    init = tmp_path / "init"
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
        [p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "verl" / script), str(r), str(world), str(init),
                               str(tmp_path), *extra], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    done = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, None))
    for r, d in enumerate(done):
        assert d.returncode == 0, f"rank {r} exited {d.returncode}:\n{d.stdout[-4000:]}"
    return done
