"""The torch side of the Megatron-LM integration that needs no Megatron-LM checkout: a micro-batch's
``PackedSeqParams``, the LR scheduler stepped by samples (megatron-core's own scheduler), and the refusal of a
Megatron-LM without ``megatron.rl`` (the megatron-core wheel has none). ci/megatron_rl_test runs the rest."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("megatron.core")

from slime_ext.integrations.megatron_rl import runtime  # noqa: E402
from slime_ext.training.thd_attention import thd_segments  # noqa: E402


def test_packed_seq_params_without_alignment_list_exactly_the_sequences():
    params = runtime.packed_seq_params([5, 3, 7], multiple=1, total=15, device="cpu")
    assert params.cu_seqlens_q.tolist() == [0, 5, 8, 15] and params.cu_seqlens_q_padded is None
    assert params.max_seqlen_q == 7 and params.qkv_format == "thd"
    assert thd_segments(params, 15) == [(0, 5), (5, 3), (8, 7)]


def test_packed_seq_params_with_cp_slots_and_a_tail():
    # cp = 2: slots of 2*cp = 4; the row padded to 24 (tp*cp = 12): the tail is one more sequence of padding
    params = runtime.packed_seq_params([5, 3, 7], multiple=4, total=24, device="cpu")
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 20, 24]
    assert params.cu_seqlens_q.tolist() == [0, 5, 8, 15, 19]
    assert getattr(params, "pad_between_seqs", True) is True  # a field from megatron-core 0.17 on
    assert thd_segments(params, 24) == [(0, 5), (8, 3), (12, 7), (20, 4)]


def test_the_lr_scheduler_steps_by_the_samples_of_the_step():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from slime_ext.training.lr import LRIncrementMismatch, StepSizedScheduler

    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)

    class Wrapped:  # megatron's scheduler reads param_groups off a MegatronOptimizer
        param_groups = optimizer.param_groups

    scheduler = OptimizerParamScheduler(Wrapped(), init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=100,
                                        lr_decay_steps=1000, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=1000, wd_incr_style="constant")
    proxy = StepSizedScheduler(scheduler, expected=5, increment=37, expected_is="micro-batches x mbs x dp")
    proxy.step(increment=5)  # megatron's train_step passes micro-batches * mbs * dp
    assert scheduler.num_steps == 37 and proxy.num_steps == 37
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.37)
    with pytest.raises(LRIncrementMismatch, match=r"increment=6.*replaces only the increment 5 \(micro-batches x "
                                                  r"mbs x dp\) by the step's 37"):
        proxy.step(increment=6)  # a host that steps differently: refused, the scheduler untouched
    assert scheduler.num_steps == 37
    scheduler.step(increment=5)  # the scheduler itself is never changed
    assert scheduler.num_steps == 42


def test_enable_refuses_a_megatron_without_its_rl_loop(monkeypatch):
    from slime_ext.integrations import megatron_rl
    from slime_ext.patches import PatchError

    if "megatron.rl" in sys.modules or _importable("megatron.rl.rl_utils"):
        pytest.skip("this environment has a Megatron-LM tree; ci/megatron_rl_test covers enable() there")
    with pytest.raises(PatchError, match="megatron.rl"):
        megatron_rl.enable()
    assert not megatron_rl.enabled()


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False
