"""The slime integration's own parts, without slime (tests/hosts runs them inside real slime revisions)."""

from __future__ import annotations

import argparse
import logging
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from slime_ext.integrations import slime as integration
from slime_ext.integrations.slime import planner, trainer
from slime_ext.patches import PatchError, on_import, slime_host
from slime_ext.schedule import ParallelConfig, ScheduleError
from slime_ext.schedule.compat import parallel_from_args
from slime_ext.training.lr import LRIncrementMismatch


def slime_args(**overrides):
    base = dict(global_batch_size=2, micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=100,
                balance_data=True, balance_by_flops=False, use_dynamic_global_batch_size=False,
                disable_rollout_trim_samples=False, use_wandb=False, use_tensorboard=False)
    return SimpleNamespace(**{**base, **overrides})


PARALLEL = {"dp_size": 2, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}


# ------------------------------------------------------------------------------------------------ options
def test_options_join_the_parser_and_parse():
    parser = argparse.ArgumentParser()
    integration.add_arguments(parser)
    ns = parser.parse_args(["--dp-schedule", "legacy", "--use-dynamic-global-batch-size", "--balance-by-flops"])
    assert ns.dp_schedule == "legacy" and ns.use_dynamic_global_batch_size and ns.balance_by_flops
    assert not ns.disable_rollout_trim_samples
    with pytest.raises(SystemExit):
        parser.parse_args(["--dp-schedule", "sometimes"])


def test_options_slime_already_has_are_left_to_slime():
    parser = argparse.ArgumentParser()
    parser.add_argument("--disable-rollout-trim-samples", action="store_true", help="slime's own")
    integration.add_arguments(parser)  # no argparse conflict
    assert parser.parse_args(["--disable-rollout-trim-samples"]).disable_rollout_trim_samples


def test_finish_routes_the_train_actor_hook_and_chains_the_users():
    args = SimpleNamespace(dp_schedule="rollout", custom_megatron_init_path="my.hooks.init")
    integration._finish(args)
    assert args.custom_megatron_init_path == integration.MEGATRON_INIT_PATH
    assert getattr(args, integration.USER_INIT_ATTR) == "my.hooks.init"
    legacy = SimpleNamespace(dp_schedule="legacy", custom_megatron_init_path=None)
    integration._finish(legacy)
    assert legacy.custom_megatron_init_path is None


def test_without_transformer_engine_slimes_spec_becomes_the_thd_layer_spec(monkeypatch):
    """No TE, no --spec: slime's ``--spec`` (Megatron's [module, name]) names the THD spec callable, whatever
    --dp-schedule; megatron-core's ``import_module`` (what slime's model_provider calls) resolves it to a callable
    that returns a layer spec with THD core attention. A user's --spec, or TE being there, leaves it alone."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.spec_utils import import_module

    from slime_ext.training.thd_attention import ThdDotProductAttention

    monkeypatch.setattr(integration, "transformer_engine_available", lambda: False)
    for schedule in ("rollout", "legacy"):
        args = SimpleNamespace(dp_schedule=schedule, custom_megatron_init_path=None, spec=None)
        integration._finish(args)
        assert args.spec == list(integration.THD_LAYER_SPEC)
    fn = import_module(args.spec)
    spec = fn(SimpleNamespace(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                              multi_latent_attention=False, moe_use_legacy_grouped_gemm=False), None, None)
    assert spec.submodules.self_attention.submodules.core_attention is ThdDotProductAttention
    mine = SimpleNamespace(dp_schedule="rollout", custom_megatron_init_path=None, spec=["my.specs", "layer"])
    integration._finish(mine)
    assert mine.spec == ["my.specs", "layer"]
    monkeypatch.setattr(integration, "transformer_engine_available", lambda: True)
    with_te = SimpleNamespace(dp_schedule="rollout", custom_megatron_init_path=None, spec=None)
    integration._finish(with_te)
    assert with_te.spec is None


def test_megatron_init_runs_the_users_hook(tmp_path, monkeypatch):
    (tmp_path / "user_hooks_for_test.py").write_text("CALLS = []\ndef init(args):\n    CALLS.append(args)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_hooks_for_test", raising=False)  # this run's module, not a cached one
    args = SimpleNamespace(dp_schedule="legacy", **{integration.USER_INIT_ATTR: "user_hooks_for_test.init"})
    integration.megatron_init(args)
    import user_hooks_for_test

    assert user_hooks_for_test.CALLS == [args]


def test_without_slime_the_revision_check_refuses_and_names_the_tags(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)  # "slime is not installed", whatever this machine has
    for detect in (slime_host.detect_revision, slime_host.train_revision):
        with pytest.raises((PatchError, ImportError)) as err:
            detect()
        if isinstance(err.value, PatchError):
            assert "v0.2.4" in str(err.value) and "v0.3.1" in str(err.value)


# ------------------------------------------------------------------------------------------------ import hook
def test_the_patch_lands_before_any_importer_sees_the_module(tmp_path, monkeypatch):
    (tmp_path / "host_mod_for_test.py").write_text("def f():\n    return 'host'\n")
    (tmp_path / "importer_for_test.py").write_text("from host_mod_for_test import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def patch(module):
        module.f = lambda: "patched"

    monkeypatch.setitem(integration._ON_IMPORT, "host_mod_for_test", patch)
    integration.enable()
    try:
        import importer_for_test  # binds f at import, as slime's modules do

        assert importer_for_test.f() == "patched"
    finally:
        on_import.remove(integration.HOOK_OWNER)


def test_launcher_without_a_script_prints_how_to_use_it(capsys):
    from slime_ext.integrations.slime.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "train.py" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ planner
def test_slime_dp_schedule_keeps_slimes_arity_keyword_and_units(caplog):
    # rollouts of 3, 1, 2, 2, 1 samples; 2 rollouts per step: 2 steps, the fifth rollout is trimmed
    ids = [0, 0, 0, 1, 2, 2, 3, 3, 4]
    lengths = [30, 20, 10, 50, 40, 40, 25, 25, 60]
    with caplog.at_level(logging.INFO, logger="slime_ext.integrations.slime"):
        out = planner.slime_dp_schedule(slime_args(), PARALLEL, lengths, global_batch_size=2, rollout_indices=ids)
    partitions, micro_batch_indices, num_microbatches, global_batch_sizes = out
    assert global_batch_sizes == [2, 2]  # rollouts per step: what slime's trainer steps LR and loss by
    assert sorted(i for p in partitions for i in p) == list(range(8))
    assert [len(m) for m in micro_batch_indices] == [sum(num_microbatches)] * 2
    assert any("dropped 1 samples of 1 trailing rollouts" in r.getMessage() for r in caplog.records)
    assert planner.last_report.dropped_samples == 1 and planner.last_report.num_steps == 2
    again = planner.slime_dp_schedule(slime_args(), PARALLEL, lengths, global_batch_size=2, group_indices=ids)
    assert again == out


def test_the_pipeline_size_and_p2p_mode_come_from_megatrons_args():
    """slime's parallel dict has no pipeline size: the integration reads it (and the p2p mode under VPP, Megatron-LM's
    default on) off Megatron's args, so the planner minimises the pipeline's makespan."""
    lengths = [30, 20, 10, 50, 40, 40, 25, 25, 60, 35, 45, 15]
    sched = planner.plan(slime_args(pipeline_model_parallel_size=4), PARALLEL, lengths, global_batch_size=12,
                         rollout_indices=list(range(12)))
    assert sched.parallel.pp_size == 4 and sched.stats[0].predicted_makespan is not None
    vpp = {**PARALLEL, "vpp_size": 2, "microbatch_group_size_per_vp_stage": 2}
    assert parallel_from_args(slime_args(pipeline_model_parallel_size=2), vpp) == ParallelConfig(
        **vpp, pp_size=2, overlap_p2p_comm=True)
    assert parallel_from_args(slime_args(pipeline_model_parallel_size=2, overlap_p2p_comm=False),
                              vpp).overlap_p2p_comm is False
    assert parallel_from_args(slime_args(), PARALLEL) == ParallelConfig(**PARALLEL)  # no pipeline args: as before
    # a size both give must agree (tests/unit/test_build_dp_schedule_entry.py: the refusal's message)
    assert parallel_from_args(slime_args(pipeline_model_parallel_size=4), {**PARALLEL, "pp_size": 4}).pp_size == 4
    with pytest.raises(ScheduleError, match="pp_size=1 but args.pipeline_model_parallel_size=4"):
        planner.plan(slime_args(pipeline_model_parallel_size=4), {**PARALLEL, "pp_size": 1}, lengths,
                     global_batch_size=12, rollout_indices=list(range(12)))


def test_the_integration_plans_the_librarys_request(monkeypatch):
    """No copy of the library's reading of slime's flags: every plan is one PlanRequest (the library's
    request_from_args), planned by slime_ext.schedule.plan; the v0.2.4 rule only sets its batch flag."""
    from slime_ext import schedule as library

    seen = []
    real = library.plan

    def record(request):
        seen.append(request)
        return real(request)

    monkeypatch.setattr(library, "plan", record)
    ids, lengths = list(range(8)), [30, 20, 10, 50, 40, 40, 25, 25]
    out = planner.slime_dp_schedule(slime_args(), PARALLEL, lengths, global_batch_size=4, rollout_indices=ids)
    assert len(seen) == 1 and isinstance(seen[0], library.PlanRequest)
    direct = library.build_dp_schedule(slime_args(), PARALLEL, lengths, global_batch_size=4, rollout_indices=ids)
    assert out == (direct.partitions, direct.micro_batch_indices, direct.num_microbatches, direct.rollouts_per_step)
    assert type(out) is tuple and all(type(part) is list for part in out)  # slime gets plain lists


def test_slime_dp_schedule_refuses_like_slime():
    with pytest.raises(AssertionError):  # slime's callers catch its asserts
        planner.slime_dp_schedule(slime_args(), PARALLEL, [5] * 4, global_batch_size=4, rollout_indices=[0, 0, 1, 1])
    with pytest.raises(ScheduleError, match="exactly one of"):
        planner.slime_dp_schedule(slime_args(), PARALLEL, [5] * 4, global_batch_size=1)


def test_rank_payloads_keep_the_v024_layout():
    n = 8
    data = {"tokens": [[i] * (10 + i) for i in range(n)], "loss_masks": [[1] * 5 for _ in range(n)],
            "rewards": [float(i) for i in range(n)], "raw_reward": [float(i) for i in range(n)],
            "sample_indices": [0, 0, 1, 2, 3, 4, 5, 6], "metadata": [{"k": i} for i in range(n)]}
    args = slime_args(global_batch_size=3, virtual_pipeline_model_parallel_size=None, context_parallel_size=1)
    payloads = planner.rank_payloads(args, data, planner.v024_parallel_config(args, 2))
    kept = sorted(i for p in payloads for i in p["partition"])
    assert kept == list(range(n - 1))  # 7 rollouts, 3 per step: the last rollout (sample 7) is trimmed
    for p in payloads:
        assert p["raw_reward"] == data["raw_reward"] and p["total_lengths"] == [10 + i for i in range(n)]
        assert "metadata" not in p
        assert p["rewards"] == [data["rewards"][i] for i in p["partition"]]
        sched = p[planner.SCHEDULE_KEY]
        assert [i for mb in sched["micro_batch_indices"] for i in mb] == list(range(len(p["partition"])))
        assert sched["samples_per_step"] == [4, 3]  # rollouts {0,1,2}: samples 0-3; {3,4,5}: samples 4-6


def v024_data(lengths, indices):
    """slime v0.2.4's train data: ``sample_indices`` is ``[sample.index for sample in samples]``."""
    n = len(lengths)
    return {"tokens": [[i] * lengths[i] for i in range(n)], "loss_masks": [[1] for _ in range(n)],
            "rewards": [0.0] * n, "raw_reward": [0.0] * n, "sample_indices": list(indices)}


def test_issue16_dynamic_global_batch_size_counts_samples_not_rollouts():
    """Issue 16: three rollouts of four samples at dp = 4 were refused ("lower --global-batch-size to at most 3",
    a flag this mode ignores); 12 samples fill all four ranks, in one step of the three whole rollouts."""
    args = slime_args(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=4096,
                      use_dynamic_global_batch_size=True)
    tpc = {"dp_size": 4, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    partitions, mbi, num_mbs, gbs = planner.slime_dp_schedule(args, tpc, [500] * 12, global_batch_size=8,
                                                              rollout_indices=[0] * 4 + [1] * 4 + [2] * 4)
    assert gbs == [3] and num_mbs == [1] and sorted(i for p in partitions for i in p) == list(range(12))
    # v0.2.4 (rank_payloads): slime's own sample rounding, 12 -> 12 at dp = 4: nothing dropped either
    payloads = planner.rank_payloads(args, v024_data([500] * 12, [0] * 4 + [1] * 4 + [2] * 4),
                                     planner.v024_parallel_config(args, 4))
    assert sorted(i for p in payloads for i in p["partition"]) == list(range(12))
    assert payloads[0][planner.SCHEDULE_KEY]["samples_per_step"] == [12]


def test_issue16_v024_dynamic_global_batch_size_follows_slimes_sample_rounding(caplog):
    """5 rollouts of 4 samples at dp = 4: rounding rollouts to a multiple of dp dropped the fifth; slime v0.2.4
    keeps all 20 samples (20 is a multiple of 4), and so does slime-ext. With 3 samples per rollout and dp = 4,
    slime keeps 12 of 15 samples: the whole rollouts inside 12 are the first four."""
    args = slime_args(use_dynamic_global_batch_size=True, max_tokens_per_gpu=4096)
    tpc = planner.v024_parallel_config(args, 4)
    payloads = planner.rank_payloads(args, v024_data([100] * 20, [i // 4 for i in range(20)]), tpc)
    assert sorted(i for p in payloads for i in p["partition"]) == list(range(20))
    with caplog.at_level(logging.INFO, logger="slime_ext.integrations.slime"):
        payloads = planner.rank_payloads(args, v024_data([100] * 15, [i // 3 for i in range(15)]), tpc)
    assert sorted(i for p in payloads for i in p["partition"]) == list(range(12))
    assert payloads[0][planner.SCHEDULE_KEY]["samples_per_step"] == [12]
    assert any("outside --use-dynamic-global-batch-size's step" in r.getMessage() for r in caplog.records)
    # the same rollout through slime >= v0.3.0's entry keeps every rollout (slime has no such flag there)
    *_, gbs = planner.slime_dp_schedule(args, tpc, [100] * 15, global_batch_size=1,
                                        rollout_indices=[i // 3 for i in range(15)])
    assert gbs == [5]


def test_issue16_a_sample_without_an_index_is_its_own_rollout():
    """8 samples with ``Sample.index`` None and 8 indexed ones at gbs = 2: the None ones were merged into one
    "rollout" (steps of [9, 2, 2, 2] samples); slime alone makes 8 steps of 2. All None: refused with a misleading
    "lower --global-batch-size"; now 8 steps of 2."""
    args = slime_args(global_batch_size=2, max_tokens_per_gpu=4096)
    tpc = planner.v024_parallel_config(args, 2)
    for indices, steps in (([None] * 8 + list(range(8)), [2] * 8), ([None] * 16, [2] * 8),
                           # ids 0 and 1 are rollouts of 4 samples; each None is one: 10 rollouts, 2 per step
                           ([0, None, 1, None] * 4, [5, 5, 2, 2, 2])):
        payloads = planner.rank_payloads(args, v024_data([50] * 16, indices), tpc)
        assert payloads[0][planner.SCHEDULE_KEY]["samples_per_step"] == steps, indices
        assert sorted(i for p in payloads for i in p["partition"]) == list(range(16))
    assert planner.last_report.num_rollouts == 10
    assert planner._dense_ids([None, None, "a", "a", None]) == [0, 1, 2, 2, 3]


# ------------------------------------------------------------------------------------------------ trainer (v0.2.4)
class V024DataIterator:
    """The constructor and ``rollout_data`` attribute slime v0.2.4's DataIterator has (the real one runs in
    tests/hosts)."""

    def __init__(self, rollout_data, micro_batch_size=None, micro_batch_indices=None):
        assert micro_batch_size is None
        self.rollout_data, self.micro_batch_indices = rollout_data, micro_batch_indices


def test_get_data_iterator_walks_the_sent_schedule_and_hides_it_from_slime():
    sched = {"micro_batch_indices": [[0, 1], [2], [3]], "num_microbatches": [1, 2], "samples_per_step": [4, 6],
             "rollouts_per_step": [2, 2]}
    rollout_data = {"tokens": [[1], [2], [3], [4]], planner.SCHEDULE_KEY: sched}
    iterators, num_mbs = trainer.get_data_iterator(None, None, rollout_data, data_iterator_cls=V024DataIterator,
                                                   vpp_size=2)
    assert num_mbs == [1, 2] and len(iterators) == 2
    assert all(it.micro_batch_indices == [[0, 1], [2], [3]] for it in iterators)
    assert trainer.step_sizes(iterators) == [4, 6] and planner.SCHEDULE_KEY not in rollout_data
    with pytest.raises(trainer.SlimeScheduleMissing, match="python -m slime_ext.integrations.slime"):
        trainer.get_data_iterator(None, None, rollout_data, data_iterator_cls=V024DataIterator, vpp_size=1)


def test_lr_and_loss_normaliser_follow_the_steps_samples():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Optimizer:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    scheduler = OptimizerParamScheduler(Optimizer(), init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0,
                                        lr_decay_steps=100, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=100, wd_incr_style="constant")
    rollout_data = {"tokens": []}
    iterators = [V024DataIterator(rollout_data, None, [[0]]) for _ in range(2)]
    for it in iterators:
        setattr(it, trainer.STEP_SAMPLES_ATTR, [5, 3])
    seen = []

    def slime_train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler,
                             num_microbatches):  # the two lines of slime v0.2.4 the wrapper acts on
        # what slime's get_batch hands loss_function as the normaliser
        seen.append(data_iterator[0].rollout_data.get("dynamic_global_batch_size", args.global_batch_size))
        opt_param_scheduler.step(increment=args.global_batch_size)

    wrapped = trainer.wrap_train_one_step(slime_train_one_step)
    args = SimpleNamespace(global_batch_size=4)
    for step in (0, 1):
        wrapped(args, 0, step, iterators, None, None, scheduler, 1)
    assert seen == [5, 3] and scheduler.num_steps == 8  # 5 + 3 samples, not 2 * global_batch_size
    plain = [V024DataIterator({"tokens": []}, None, [[0]])]  # slime's own path: untouched
    wrapped(args, 0, 0, plain, None, None, scheduler, 1)
    assert scheduler.num_steps == 12 and seen[-1] == 4 and "dynamic_global_batch_size" not in plain[0].rollout_data
    bad_slime = trainer.wrap_train_one_step(lambda args, r, s, it, m, o, scheduler, n: scheduler.step(increment=7))
    with pytest.raises(LRIncrementMismatch, match=r"increment=7.*the increment 4 \(slime v0.2.4's --global-batch"):
        bad_slime(args, 0, 0, iterators, None, None, scheduler, 1)
    assert scheduler.num_steps == 12


def test_pipelined_plans_put_each_steps_predicted_makespan_bubble_and_count_into_slimes_metrics():
    """Issue 15: with --pipeline-model-parallel-size, slime's rollout metrics carry every step's prediction."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(100, 4000, size=32).tolist()
    args = slime_args(pipeline_model_parallel_size=4, max_tokens_per_gpu=4096)
    planner.slime_dp_schedule(args, PARALLEL, lengths, global_batch_size=16, rollout_indices=list(range(32)))
    report = planner.last_report
    schedule = planner.plan(args, PARALLEL, lengths, global_batch_size=16, rollout_indices=list(range(32)))
    assert report.num_steps == 2 and len(report.predicted_makespans) == 2
    metrics = report.metrics()
    for s, stats in enumerate(schedule.stats):
        assert metrics[f"rollout/slime_ext/step_{s}/predicted_makespan"] == stats.predicted_makespan > 0
        assert metrics[f"rollout/slime_ext/step_{s}/bubble"] == stats.bubble_fraction
        assert 0 < stats.bubble_fraction < 1
        assert metrics[f"rollout/slime_ext/step_{s}/microbatches_per_rank"] == schedule.num_microbatches[s]
    assert metrics["rollout/slime_ext/pipeline_makespan"] == pytest.approx(
        sum(s.predicted_makespan for s in schedule.stats))
    assert min(report.bubble_fractions) <= metrics["rollout/slime_ext/pipeline_bubble"] <= max(report.bubble_fractions)
    # without a pipeline, no pipeline keys
    planner.slime_dp_schedule(slime_args(max_tokens_per_gpu=4096), PARALLEL, lengths, global_batch_size=16,
                              rollout_indices=list(range(32)))
    assert not any("pipeline" in k or "/step_" in k for k in planner.last_report.metrics())
