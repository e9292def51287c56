"""The planning layer must not import torch, ray or megatron (it runs on the rollout side, in CPU-only CI)."""

import subprocess
import sys

FORBIDDEN = ("torch", "ray", "megatron")


def test_schedule_imports_no_torch_ray_megatron():
    code = (
        "import sys\n"
        "import slime_ext.schedule, slime_ext.schedule.planner\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"slime_ext.schedule pulled in: {out.stdout.strip()}"
