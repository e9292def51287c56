"""A bad run config is rejected before any process starts: no Ray, no train process, a message naming the key.

The in-process checks replace ``ray.init`` with a tripwire, so "nothing started" is asserted, not assumed; the CLI
check runs ``python -m slime_ext.run`` as a user would and expects exit status 2 and the message on stderr.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray

from rollout_harness import CONFIGS, REPO
from slime_ext.rollout import driver

pytestmark = [pytest.mark.e2e]

BASE = CONFIGS / "e2e" / "dp2_dynamic_balanced.yaml"

BAD = {
    "dp_x_pp_not_world": (
        ["data_parallel_size=2", "pipeline_model_parallel_size=2", "num_layers=4"],
        ["data_parallel_size=2", "= 4 but actor_num_nodes x actor_num_gpus_per_node = 2", "data_parallel_size: 1"]),
    "world_not_multiple_of_pp": (
        ["actor_num_gpus_per_node=3", "data_parallel_size=null", "pipeline_model_parallel_size=2", "num_layers=4"],
        ["3 train processes is not a multiple of", "actor_num_gpus_per_node to a multiple of 2"]),
    "unknown_key": (
        ["micro_batch_sise=2"],
        ["unknown key 'micro_batch_sise'", "did you mean 'micro_batch_size'"]),
    "static_not_divisible": (
        ["use_dynamic_batch_size=false", "micro_batch_size=4", "synthetic_multi_sample_prob=0"],
        ["1 micro-batches of micro_batch_size=4", "not a multiple of dp_size*mb_group = 2",
         "is a multiple of dp_size*mb_group (set --global-batch-size and --micro-batch-size"]),
    "static_with_multi_sample_rollouts": (
        ["use_dynamic_batch_size=false", "micro_batch_size=2"],
        ["micro_batch_size=2", "synthetic_multi_sample_prob: 0", "use_dynamic_batch_size: true"]),
    "cap_below_every_sample_static": (
        ["use_dynamic_batch_size=false", "micro_batch_size=2", "synthetic_multi_sample_prob=0",
         "max_tokens_per_gpu=3"],
        ["max_tokens_per_gpu=3 is below every sample", "raise max_tokens_per_gpu"]),
    "legacy_gbs_not_multiple_of_dp": (
        ["dp_schedule=legacy", "global_batch_size=5"],
        ["global_batch_size=5 (samples per step on the legacy path) must be a positive multiple of dp_size=2"]),
}


def _args(sets):
    return ["--config", str(BASE), *[a for s in sets for a in ("--set", s)]]


@pytest.fixture
def no_ray(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("ray.init was called for a config that should have been rejected")

    monkeypatch.setattr(ray, "init", tripwire)
    assert not ray.is_initialized()
    yield
    assert not ray.is_initialized()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_rejected_before_any_process(case, no_ray, capsys):
    sets, expected = BAD[case]
    status = driver.main(_args(sets))
    err = capsys.readouterr().err
    assert status == 2, err
    for text in expected:
        assert text in err, f"{case}: {text!r} missing from:\n{err}"


def test_good_config_passes_the_same_gate(no_ray, capsys):
    """The tripwire is really reached by a valid config (so the rejections above are the validation's doing)."""
    assert driver.main(_args([])) == 1
    assert "ray.init was called" in capsys.readouterr().err


def test_cli_exit_status_and_message():
    proc = subprocess.run([sys.executable, "-m", "slime_ext.run", *_args(["micro_batch_sise=2"])], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "unknown key 'micro_batch_sise': did you mean 'micro_batch_size'?" in proc.stderr
    assert "Traceback" not in proc.stderr
