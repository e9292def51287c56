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


def test_schemes_import_their_training_half_only_when_called():
    """Every dp_schedule scheme is importable where planning runs (rollout process, CLI, benchmark): no torch, ray,
    megatron or slime_ext.training until a training-side method is called."""
    code = (
        "import sys\n"
        "import slime_ext.schemes\n"
        "from slime_ext.schemes import SCHEMES, BASELINES\n"
        f"bad = sorted(m for m in sys.modules\n"
        f"             if m.split('.')[0] in {FORBIDDEN!r} or m.startswith('slime_ext.training'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"slime_ext.schemes pulled in: {out.stdout.strip()}"


def test_rollout_layer_does_not_import_the_training_layer():
    code = (
        "import sys\n"
        "import slime_ext.rollout.driver, slime_ext.rollout.config, slime_ext.rollout.dispatch\n"
        "bad = sorted(m for m in sys.modules if m.startswith('slime_ext.training') or m.split('.')[0] == 'torch')\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"slime_ext.rollout pulled in: {out.stdout.strip()}"


def test_patches_import_no_slime_ext_layer_above_them():
    """Patches say where slime-ext enters third-party code; what enters is handed to them (no import upwards)."""
    import ast
    from pathlib import Path

    import slime_ext.patches

    upward = ("slime_ext.integrations", "slime_ext.training", "slime_ext.rollout", "slime_ext.cli")
    found = []
    for path in sorted(Path(slime_ext.patches.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}: {n}" for n in names if n.startswith(upward)]
    assert found == []


def test_schedule_public_api_is_the_contract_and_its_entry_points():
    import slime_ext.schedule as schedule

    assert sorted(schedule.__all__) == sorted([
        "BatchConfig", "ParallelConfig", "CostModel", "CostProfile",  # what a plan is asked for
        "PlanRequest", "plan",  # the one request and its entry point
        "plan_schedule", "build_dp_schedule", "check_schedule",  # its keyword form, slime's signature; verify
        "PlannerConfig",  # every tunable of the planner, with a default
        "DPSchedule", "StepStats", "RankPayload", "SampleBatch", "ScheduleError",  # what comes back
        # for integrations that plan inside a host's engine (verl): the pipeline objective (its pricing, the
        # planner's price of micro-batches, the order search, the per-sample costs the planner balances) and the
        # model itself
        "PipelinePricing", "pipeline_pricing", "microbatch_costs", "best_orders", "sample_costs",
        "PipelineSpec", "pipeline_makespan",
        # one replica's samples in exactly `count` micro-batches, by the planner's shaping (a host planning a rank)
        "shape_replica", "ReplicaPlan", "scan_replica", "ReplicaScan", "pack_replica",
    ])
    assert all(getattr(schedule, name) is not None for name in schedule.__all__)
