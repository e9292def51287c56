"""Layer purity: planning imports no torch, ray or megatron; the rollout layer imports no training layer."""

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


def test_rollout_layer_does_not_import_the_training_layer():
    code = (
        "import sys\n"
        "import slime_ext.rollout.driver, slime_ext.rollout.config, slime_ext.rollout.dispatch\n"
        "bad = sorted(m for m in sys.modules if m.startswith('slime_ext.training') or m.split('.')[0] == 'torch')\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"slime_ext.rollout pulled in: {out.stdout.strip()}"
