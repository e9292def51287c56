"""slime-ext's NeMo-RL integration without NeMo-RL: the plan as NeMo-RL's shard metadata (:mod:`.plan`), the
policy-config refusals (:mod:`.settings`), the ``Policy.__init__`` replacement against a stand-in, and the
launcher's argument split. NeMo-RL's own code runs in ``tests/nemo_rl`` (``ci/nemo_rl_test``)."""

from __future__ import annotations

import copy
import dataclasses
import random

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st

from slime_ext.integrations.nemo_rl.plan import (ShardPlan, check_shard_plan, choose_padded, micro_batch_rows,
                                                 padded_pass_time, plan_shards)
from slime_ext.integrations.nemo_rl.runtime import LAYOUT_ATTRIBUTE, make_policy_init
from slime_ext.integrations.nemo_rl.settings import (NemoRLSettingError, Options, layout_from_config,
                                                     run_as_packing)
from slime_ext.schedule import CostModel, ParallelConfig, ScheduleError


def lengths_of(n: int, seed: int = 0, longest: int = 3000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(20, longest) for _ in range(n)]


def worker_view(plan: ShardPlan, lengths: list[int], pad: int) -> dict:
    """What NeMo-RL's worker would see, recomputed from the rows alone (not from the plan's own numbers)."""
    seen, counts, packed = [], [], []
    for r in range(plan.dp_size):
        rows, offset = plan.rows[r], 0
        for g, count in enumerate(plan.elem_counts_per_gb[r]):
            gb_rows = rows[offset:offset + count]
            offset += count
            for (start, end), tokens in zip(plan.micro_batch_indices[r][g], plan.micro_batch_lengths[r][g],
                                            strict=True):
                seen += gb_rows[start:end]
                packed.append((end - start, sum(-(-lengths[i] // pad) * pad for i in gb_rows[start:end]), tokens))
            counts.append((g, len(plan.micro_batch_indices[r][g])))
    return {"seen": seen, "counts": counts, "packed": packed}


@pytest.mark.parametrize("dp,pp,vpp", [(2, 1, 1), (4, 2, 1), (2, 4, 1), (2, 2, 2)])
def test_every_row_once_equal_counts_cap_held(dp, pp, vpp):
    lengths = lengths_of(128, seed=dp * pp)
    plan = plan_shards(lengths, parallel=ParallelConfig(dp_size=dp, pp_size=pp, vpp_size=vpp), batch_size=64,
                       cap=8192, pad_multiple=16)
    view = worker_view(plan, lengths, 16)
    assert sorted(view["seen"]) == list(range(128))
    for g in range(2):
        per_rank = {n for gg, n in view["counts"] if gg == g}
        assert len(per_rank) == 1 and next(iter(per_rank)) % vpp == 0
    for rows, tokens, announced in view["packed"]:
        assert tokens == announced and (rows == 1 or tokens <= 8192)
    assert plan.sorted_indices == [i for r in plan.rows for i in r]


def test_global_batches_keep_nemo_rls_rows():
    """Global batch ``g`` trains rows ``g*batch_size .. (g+1)*batch_size - 1``, as NeMo-RL chunks them."""
    plan = plan_shards(lengths_of(96), parallel=ParallelConfig(dp_size=4), batch_size=32, cap=6000)
    for r in range(4):
        offset = 0
        for g, count in enumerate(plan.elem_counts_per_gb[r]):
            assert all(i // 32 == g for i in plan.rows[r][offset:offset + count])
            offset += count


def test_log_prob_pass_is_forward_only_under_its_own_cap():
    lengths = lengths_of(64, seed=2)
    train = plan_shards(lengths, parallel=ParallelConfig(dp_size=2, pp_size=4), batch_size=None, cap=4096)
    logprob = plan_shards(lengths, parallel=ParallelConfig(dp_size=2, pp_size=4), batch_size=None, cap=16384,
                          forward_only=True)
    assert logprob.forward_only and logprob.schedule.forward_only and not train.schedule.forward_only
    assert logprob.cap == 16384 and train.cap == 4096
    assert max(len(mb) for mb in logprob.micro_batch_indices[0][0]) >= 1
    assert sum(logprob.schedule.num_microbatches) <= sum(train.schedule.num_microbatches)


def test_context_parallel_cap_is_per_micro_batch_before_the_split():
    lengths = lengths_of(32, seed=4, longest=1500)
    plan = plan_shards(lengths, parallel=ParallelConfig(dp_size=2, cp_size=2), batch_size=16, cap=4001,
                       pad_multiple=4)
    assert plan.cap == 4000  # floored to a multiple of cp
    assert all(t <= 4000 for r in plan.micro_batch_lengths for g in r for t in g)


def test_a_row_longer_than_the_cap_sits_alone():
    lengths = [5000, 100, 200, 300, 400, 500, 600, 700]
    plan = plan_shards(lengths, parallel=ParallelConfig(dp_size=2), batch_size=8, cap=1024)
    view = worker_view(plan, lengths, 1)
    assert (1, 5000, 5000) in view["packed"]


def test_cost_model_moves_the_plan_but_not_the_invariants():
    lengths = lengths_of(64, seed=7, longest=8000)
    model = CostModel(hidden_size=1024, num_layers=16, num_attention_heads=16, vocab_size=32000)
    plan = plan_shards(lengths, parallel=ParallelConfig(dp_size=4, pp_size=2), batch_size=32, cap=16384,
                       cost_model=model)
    check_shard_plan(plan, batch_size=32)


@hsettings(max_examples=25, deadline=None)
@given(st.data())
def test_invariants_over_layouts(data):
    dp = data.draw(st.sampled_from([1, 2, 4]))
    pp = data.draw(st.sampled_from([1, 2, 4]))
    vpp = data.draw(st.sampled_from([1, 2])) if pp > 1 else 1
    steps = data.draw(st.integers(1, 3))
    parallel = ParallelConfig(dp_size=dp, pp_size=pp, vpp_size=vpp)
    per_step = parallel.align * data.draw(st.integers(1, 6))  # every micro-batch slot of a step needs a row
    lengths = data.draw(st.lists(st.integers(1, 4000), min_size=steps * per_step, max_size=steps * per_step))
    pad = data.draw(st.sampled_from([1, 8, 64]))
    plan = plan_shards(lengths, parallel=parallel, batch_size=per_step,
                       cap=data.draw(st.integers(1024, 16384)), pad_multiple=pad,
                       forward_only=data.draw(st.booleans()))
    view = worker_view(plan, lengths, pad)
    assert sorted(view["seen"]) == list(range(len(lengths)))
    for rows, tokens, announced in view["packed"]:
        assert tokens == announced and (rows == 1 or tokens <= plan.cap)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(batch_size=30), "does not divide the 64 rows"),
    (dict(batch_size=2), "not a multiple of the 4 DP shards"),
    (dict(cap=0), "max_tokens_per_microbatch = 0"),
    (dict(pad_multiple=0), "sequence_length_pad_multiple = 0"),
])
def test_bad_shard_calls_are_refused_naming_the_setting(kwargs, needle):
    args = dict(parallel=ParallelConfig(dp_size=4), batch_size=32, cap=4096)
    with pytest.raises(ScheduleError, match=needle):
        plan_shards(lengths_of(64), **{**args, **kwargs})


def test_an_empty_row_is_refused():
    with pytest.raises(ScheduleError, match=r"input_lengths\[2\] = 0"):
        plan_shards([10, 20, 0, 30], parallel=ParallelConfig(dp_size=2), batch_size=4, cap=100)


def test_the_checker_catches_a_broken_plan():
    lengths = lengths_of(32)
    plan = plan_shards(lengths, parallel=ParallelConfig(dp_size=2), batch_size=16, cap=8000)
    dropped = dataclasses.replace(plan, rows=(plan.rows[0][:-1], plan.rows[1]))
    with pytest.raises(ScheduleError, match="exactly once"):
        check_shard_plan(dropped, batch_size=16)
    lying = dataclasses.replace(plan, micro_batch_lengths=(tuple((g[0] + 1, *g[1:]) for g in plan.micro_batch_lengths[0]),
                                                           plan.micro_batch_lengths[1]))
    with pytest.raises(ScheduleError, match="says"):
        check_shard_plan(lying, batch_size=16)
    uneven = dataclasses.replace(plan, micro_batch_indices=(plan.micro_batch_indices[0],
                                                            tuple(g[:-1] for g in plan.micro_batch_indices[1])))
    with pytest.raises(ScheduleError, match="micro-batches"):
        check_shard_plan(uneven, batch_size=16)


# ---------------------------------------------------------------- settings

def policy_config(**overrides) -> dict:
    cfg = {
        "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
                         "context_parallel_size": 2, "sequence_parallel": True},
        "sequence_packing": {"enabled": True, "train_mb_tokens": 8192, "logprob_mb_tokens": 16384,
                             "algorithm": "modified_first_fit_decreasing"},
        "dynamic_batching": {"enabled": False, "train_mb_tokens": 4096, "logprob_mb_tokens": 8192,
                             "sequence_length_round": 64},
        "make_sequence_length_divisible_by": 8,
    }
    for path, value in overrides.items():
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def test_layout_from_config():
    layout = layout_from_config(policy_config())
    assert (layout.pp_size, layout.vpp_size, layout.cp_size, layout.tp_size) == (4, 1, 2, 2)
    assert layout.cap(False) == 8192 and layout.cap(True) == 16384 and layout.pad_multiple == 8
    parallel = layout.parallel(8)
    assert (parallel.dp_size, parallel.pp_size, parallel.cp_size) == (8, 4, 2)


@pytest.mark.parametrize("overrides,needle", [
    ({"megatron_cfg.enabled": False}, "Megatron backend only"),
    ({"sequence_packing.enabled": False}, "nothing to plan"),
    ({"sequence_packing.train_mb_tokens": None}, "policy.sequence_packing.train_mb_tokens = None"),
    ({"sequence_packing.logprob_mb_tokens": 1}, "below context_parallel_size = 2"),
    ({"megatron_cfg.variable_seq_lengths": True, "megatron_cfg.batch_p2p_comm": True},
     "set policy.megatron_cfg.batch_p2p_comm=false"),
    ({"make_sequence_length_divisible_by": 0}, "make_sequence_length_divisible_by = 0"),
    ({"megatron_cfg.virtual_pipeline_model_parallel_size": -2}, "virtual_pipeline_model_parallel_size = -2"),
    ({"megatron_cfg.virtual_pipeline_model_parallel_size": 2.0}, "virtual_pipeline_model_parallel_size = 2.0"),
    ({"megatron_cfg.batch_p2p_comm": True}, "batch_p2p_comm=false, or start the launcher with --pad-to-longest"),
    ({"quant_cfg": {"algorithm": "fp8"}}, "quant_cfg is set: .* --pad-to-longest"),
])
def test_settings_slime_ext_cannot_honour_are_refused(overrides, needle):
    with pytest.raises(NemoRLSettingError, match=needle):
        layout_from_config(policy_config(**overrides))


def test_variable_lengths_with_batched_p2p_are_fine_below_four_stages():
    cfg = policy_config(**{"megatron_cfg.pipeline_model_parallel_size": 2, "megatron_cfg.variable_seq_lengths": True,
                           "megatron_cfg.batch_p2p_comm": True})
    assert layout_from_config(cfg).pp_size == 2


def test_dynamic_batching_runs_as_packing_with_its_caps():
    cfg = policy_config(**{"sequence_packing.enabled": False, "dynamic_batching.enabled": True})
    before = copy.deepcopy(cfg)
    converted = run_as_packing(cfg)
    assert cfg == before  # the caller's config is not changed
    assert converted["sequence_packing"]["enabled"] and not converted["dynamic_batching"]["enabled"]
    assert converted["sequence_packing"]["train_mb_tokens"] == 4096
    assert converted["sequence_packing"]["logprob_mb_tokens"] == 8192
    assert layout_from_config(cfg).train_mb_tokens == 4096
    assert run_as_packing(policy_config()) is None


def nemo_rl_like_init(calls: list):
    """A stand-in for NeMo-RL's ``Policy.__init__`` with its parameters (HEAD 7ea279a), recording what it gets."""

    def __init__(self, cluster, config, tokenizer, name_prefix="lm_policy", workers_per_node=None,
                 init_optimizer=True, weights_path=None, optimizer_path=None, init_reference_model=True,
                 processor=None, worker_extension_cls_fqn=None, skip_weight_load=False):
        if config["dynamic_batching"]["enabled"]:
            assert config["megatron_cfg"]["pipeline_model_parallel_size"] == 1, "Dynamic batching is only ..."
        calls.append((cluster, config, tokenizer, name_prefix, worker_extension_cls_fqn, skip_weight_load))

    return __init__


@pytest.fixture
def workers_import_slime_ext(monkeypatch):
    """The registry's worker environment is this interpreter (no NeMo-RL needed to look it up)."""
    import sys

    from slime_ext.integrations.nemo_rl import runtime

    monkeypatch.setattr(runtime, "worker_executable", lambda: sys.executable)


def test_policy_init_replacement_checks_converts_and_remembers(workers_import_slime_ext):
    """The ``Policy.__init__`` replacement against a stand-in for NeMo-RL's: the stand-in asserts what NeMo-RL's
    does (dynamic batching only at one pipeline stage), and the replacement gets past it by packing."""
    calls = []

    class Policy:
        __init__ = make_policy_init(nemo_rl_like_init(calls))

    cfg = policy_config(**{"sequence_packing.enabled": False, "dynamic_batching.enabled": True})
    policy = Policy("cluster", cfg, "tokenizer", name_prefix="p")
    (_, passed, tokenizer, prefix, _, _), = calls
    assert passed["sequence_packing"]["enabled"] and (tokenizer, prefix) == ("tokenizer", "p")
    assert getattr(policy, LAYOUT_ATTRIBUTE).pp_size == 4
    with pytest.raises(NemoRLSettingError, match="Megatron backend only"):
        Policy("cluster", policy_config(**{"megatron_cfg.enabled": False}))
    assert len(calls) == 1  # refused before NeMo-RL's own __init__ ran


def test_options_are_checked():
    with pytest.raises(NemoRLSettingError, match="not both"):
        Options(cost_model=CostModel(hidden_size=8, num_layers=2, num_attention_heads=2), cost_profile="x.json")
    with pytest.raises(NemoRLSettingError, match="must be a CostModel"):
        Options(cost_model={"hidden_size": 8})


def test_launcher_splits_its_options_from_the_scripts(tmp_path):
    from slime_ext.integrations.nemo_rl.__main__ import parse

    script = tmp_path / "run_grpo.py"
    script.write_text("")
    ns, path, rest = parse(["--cost-profile", "p.json", str(script), "--config", "x.yaml", "policy.a=1"])
    assert ns.cost_profile == "p.json" and path == str(script) and rest == ["--config", "x.yaml", "policy.a=1"]
    assert not ns.pad_to_longest
    ns, _, rest = parse(["--pad-to-longest", str(script), "--pad-to-longest"])
    assert ns.pad_to_longest and rest == ["--pad-to-longest"]  # after the script: the script's own
    with pytest.raises(SystemExit):
        parse([str(tmp_path / "missing.py")])


def test_the_patches_name_their_targets_and_range():
    from slime_ext.integrations.nemo_rl import runtime
    from slime_ext.patches.nemo_rl_host import SUPPORTED, nemo_rl_patches

    patches = nemo_rl_patches(runtime)
    assert {p.target for p in patches} == {
        "nemo_rl.distributed.batched_data_dict.BatchedDataDict.shard_by_batch_size",
        "nemo_rl.models.policy.lm_policy.Policy._shard_for_train",
        "nemo_rl.models.policy.lm_policy.Policy._shard_for_logprob",
        "nemo_rl.models.policy.lm_policy.Policy.__init__"}
    assert all(p.supported == SUPPORTED and p.distribution == "nemo-rl" for p in patches)


def test_pad_to_longest_picks_a_count_no_slower_under_that_padding():
    """Under PP NeMo-RL's worker pads a rank's micro-batches to the longest: the pad-aware plan is priced (with the
    pipeline model, independently of the chooser) no slower than the planner's own choice, and both hold the
    invariants."""
    from slime_ext.schedule import pipeline_pricing

    lengths = lengths_of(128, seed=11, longest=9000)
    model = CostModel(hidden_size=2048, num_layers=24, num_attention_heads=16, vocab_size=32000)
    parallel = ParallelConfig(dp_size=4, pp_size=4)
    plans = [plan_shards(lengths, parallel=parallel, batch_size=64, cap=16384, cost_model=model, pad_to_longest=p)
             for p in (False, True)]
    pricing = pipeline_pricing(parallel, model, 16384)

    def padded_time(plan):
        total = 0.0
        for g in range(plan.num_global_batches):
            costs = []
            for r in range(4):
                start = sum(plan.elem_counts_per_gb[r][:g])
                rows = plan.rows[r][start:start + plan.elem_counts_per_gb[r][g]]
                width = max(plan.micro_batch_lengths[r][g])
                linear = model.coefficients()[0]
                costs.append([float(model.flops([lengths[i] for i in rows[s:e]]).sum()) + linear * (width - t)
                              for (s, e), t in zip(plan.micro_batch_indices[r][g], plan.micro_batch_lengths[r][g])])
            total += float(pricing.makespans(np.array(costs)).max())
        return total

    assert padded_time(plans[1]) <= padded_time(plans[0]) * 1.0001
    assert plans[0].padded_time is None and plans[1].padded_time == pytest.approx(padded_time(plans[1]), rel=1e-9)


# ------------------------------------------------- NeMo-RL's own plan as a candidate under the pad to the longest

#: eight rows of 1000 tokens in one global batch, DP 2 x PP 2, cap 3000: ``EVEN`` packs two rows per micro-batch
#: (2 x 2000 tokens per rank); ``LOPSIDED`` one row then three (1000 padded to 3000, and 3000), the same count
ROWS_1000 = [1000] * 8
PP2 = ParallelConfig(dp_size=2, pp_size=2)
EVEN = [[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]
LOPSIDED = [[[[0], [1, 2, 3]], [[4], [5, 6, 7]]]]


def test_the_pad_is_priced_as_the_longest_micro_batchs_tokens():
    """``LOPSIDED`` padded runs what four micro-batches of 3000 real tokens run (priced by tokens); ``EVEN`` is
    cheaper, having the same count and less to compute."""
    def time(plan, lengths):
        return padded_pass_time(plan, lengths, parallel=PP2, cap=3000, forward_only=False)

    full = [1500] * 8  # 2 x 1500 = 3000 real tokens in every micro-batch of EVEN's shape
    assert time(LOPSIDED, ROWS_1000) == pytest.approx(time(EVEN, full), rel=1e-12)
    assert time(EVEN, ROWS_1000) < time(LOPSIDED, ROWS_1000)
    with pytest.raises(ScheduleError, match="pipeline parallelism only"):
        padded_pass_time(EVEN, ROWS_1000, parallel=ParallelConfig(dp_size=2), cap=3000, forward_only=False)


def test_a_pad_token_costs_the_per_token_rate():
    """The one pricing of the pad: a micro-batch padded from 1000 to 3000 tokens costs its row's FLOPs plus 2000
    tokens at the model's linear rate (not 3x its row's FLOPs, which would charge the pad attention too)."""
    from slime_ext.integrations.nemo_rl.plan import padded_micro_batch_costs

    model = CostModel(hidden_size=1024, num_layers=16, num_attention_heads=16, vocab_size=32000)
    linear, quadratic = model.coefficients()
    costs = padded_micro_batch_costs([[0], [1, 2, 3]], ROWS_1000, model)
    one = linear * 1000 + quadratic * 1000 ** 2
    assert costs.tolist() == pytest.approx([one + linear * 2000, 3 * one], rel=1e-12)
    assert padded_micro_batch_costs([[0], [1, 2, 3]], ROWS_1000, None).tolist() == [3000, 3000]
    assert padded_micro_batch_costs([[0], [1, 2, 3]], ROWS_1000, None, width=4000).tolist() == [4000, 4000]


@pytest.mark.parametrize("forward_only", [False, True])
def test_the_faster_plan_wins_and_ours_a_tie(forward_only):
    def choose(ours, theirs):
        pricing = dict(parallel=PP2, cap=3000, forward_only=forward_only)
        return choose_padded(padded_pass_time(ours, ROWS_1000, **pricing), theirs, ROWS_1000, **pricing)

    assert not choose(EVEN, LOPSIDED).theirs_wins
    won = choose(LOPSIDED, EVEN)
    assert won.theirs_wins and won.theirs < won.ours and not won.why_not
    tie = choose(EVEN, [[list(reversed(rank)) for rank in gb] for gb in EVEN])
    assert tie.theirs == tie.ours and not tie.theirs_wins


@pytest.mark.parametrize("theirs,parallel,needle", [
    ([[[[0, 1], [2]], [[4, 5], [6, 7]]]], PP2, "exactly once"),                       # row 3 lost: less to run
    ([[[[0, 1, 2, 3]], [[4, 5], [6, 7]]]], PP2, "counts"),                            # one rank one micro-batch
    ([[[[0, 1, 2, 3]], [[4, 5, 6, 7]]]], PP2, "above the cap"),                       # 4000 tokens under a 3000 cap
    ([[[[0, 1, 2, 3]], [[4, 5, 6, 7]]]], ParallelConfig(dp_size=2, pp_size=2, vpp_size=2), "multiple of 2"),
])
def test_a_plan_that_cannot_run_is_no_candidate(theirs, parallel, needle):
    cap = 4000 if parallel.vpp_size > 1 else 3000
    choice = choose_padded(1.0, theirs, ROWS_1000, parallel=parallel, cap=cap, forward_only=False)
    assert choice.theirs is None and needle in choice.why_not and not choice.theirs_wins


def test_micro_batch_rows_read_nemo_rls_metadata():
    """Shard 0 holds rows 5, 1 (global batch 0) and 9, 8, 12 (global batch 1); shard 1 holds 0, 3 and 10, 14, 11."""
    rows = [[5, 1, 9, 8, 12], [0, 3, 10, 14, 11]]
    indices = [[[[0, 1], [1, 2]], [[0, 2], [2, 3]]], [[[0, 2], [2, 2]], [[0, 1], [1, 3]]]]
    assert micro_batch_rows(rows, indices, [[2, 3], [2, 3]]) == [
        [[[5], [1]], [[0, 3], []]], [[[9, 8], [12]], [[10], [14, 11]]]]
    with pytest.raises(ScheduleError, match="shard 1"):
        micro_batch_rows(rows, indices, [[2, 3], [2, 2]])


def test_a_shard_plan_as_micro_batch_rows():
    """A plan's rows per micro-batch sum to the lengths its metadata announces, rank by rank, global batch by global
    batch (the form :func:`choose_padded` prices)."""
    lengths = lengths_of(64, seed=5, longest=6000)
    plan = plan_shards(lengths, parallel=ParallelConfig(dp_size=2, pp_size=4), batch_size=32, cap=16384, pad_multiple=8,
                       pad_to_longest=True)
    rows = plan.micro_batch_rows()
    assert len(rows) == 2 and all(len(gb) == 2 for gb in rows)
    for g, gb in enumerate(rows):
        for r, mbs in enumerate(gb):
            assert [sum(-(-lengths[i] // 8) * 8 for i in mb) for mb in mbs] == list(plan.micro_batch_lengths[r][g])
            assert all(i // 32 == g for mb in mbs for i in mb)


def test_under_pp_the_workers_run_unpadded_unless_pad_to_longest():
    cfg = policy_config(**{"megatron_cfg.batch_p2p_comm": True, "quant_cfg": {"algorithm": "fp8"}})
    layout = layout_from_config(policy_config())
    assert layout.variable_seq_lengths and not layout.padded_to_longest  # the default under PP
    opted_out = layout_from_config(cfg, pad_to_longest=True)  # NeMo-RL's workers: nothing of theirs refused
    assert not opted_out.variable_seq_lengths and opted_out.padded_to_longest
    one_stage = policy_config(**{"megatron_cfg.pipeline_model_parallel_size": 1, "megatron_cfg.batch_p2p_comm": True,
                                 "quant_cfg": {"algorithm": "fp8"}})
    for pad_to_longest in (False, True):  # one stage: nothing about the workers changes
        layout = layout_from_config(one_stage, pad_to_longest=pad_to_longest)
        assert not layout.variable_seq_lengths and not layout.padded_to_longest


#: the position of worker_extension_cls_fqn after ``self, cluster, config`` in NeMo-RL HEAD's Policy.__init__
NEMO_RL_WORKER_CLASS_POSITION = 8


def test_slime_exts_worker_class_is_passed_under_pp_by_default(workers_import_slime_ext):
    from slime_ext.integrations.nemo_rl import runtime
    from slime_ext.integrations.nemo_rl.worker import WORKER_CLASS_FQN

    calls = []

    class Policy:
        __init__ = make_policy_init(nemo_rl_like_init(calls))

    Policy("cluster", policy_config(), "tokenizer")
    assert calls[-1][4] == WORKER_CLASS_FQN
    before = tuple(f"arg{i}" for i in range(NEMO_RL_WORKER_CLASS_POSITION - 1))
    Policy("cluster", policy_config(), "tokenizer", *before, None, True)  # passed by position, left None
    assert calls[-1][4:] == (WORKER_CLASS_FQN, True)
    with pytest.raises(NemoRLSettingError, match="start the launcher with --pad-to-longest"):
        Policy("cluster", policy_config(), "tokenizer", worker_extension_cls_fqn="my.Worker")
    Policy("cluster", policy_config(**{"megatron_cfg.pipeline_model_parallel_size": 1}), "tokenizer")
    assert calls[-1][4] is None  # one stage: NeMo-RL's own worker class
    runtime.STATE.options = Options(pad_to_longest=True)
    try:
        Policy("cluster", policy_config(), "tokenizer", worker_extension_cls_fqn="my.Worker")
        assert calls[-1][4] == "my.Worker"  # the opt-out: the caller's class, NeMo-RL's pad
    finally:
        runtime.STATE.__init__()


def test_the_worker_class_position_is_read_off_the_signature():
    from slime_ext.patches import PatchError
    from slime_ext.patches.nemo_rl_host import worker_class_position

    assert worker_class_position(nemo_rl_like_init([])) == NEMO_RL_WORKER_CLASS_POSITION

    def moved(self, cluster, config, tokenizer, worker_extension_cls_fqn=None):
        pass

    def without(self, cluster, config, tokenizer):
        pass

    assert worker_class_position(moved) == 1
    with pytest.raises(PatchError, match="no parameter worker_extension_cls_fqn"):
        worker_class_position(without)
    with pytest.raises(PatchError, match="no parameter worker_extension_cls_fqn"):
        make_policy_init(without)


def test_a_worker_environment_without_slime_ext_is_named(tmp_path, caplog):
    """A worker Python that cannot import slime-ext is refused before the workers start; a ``uv`` environment
    (built later from NeMo-RL's lock) gets a warning unless PYTHONPATH holds slime-ext; the import error of a worker
    that lacks it becomes one error naming the fixes."""
    import logging
    import os
    import sys

    import slime_ext
    from slime_ext.integrations.nemo_rl.worker import check_worker_environment, missing_slime_ext_named

    lacking = tmp_path / "python-without-slime-ext"
    lacking.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'slime_ext'\" >&2\nexit 1\n")
    having = tmp_path / "python-with-slime-ext"
    having.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    for script in (lacking, having):
        script.chmod(0o755)
    with pytest.raises(NemoRLSettingError, match="cannot import slime-ext's worker class .*No module named "
                                                 "'slime_ext'.*PYTHONPATH.*NEMO_RL_PY_EXECUTABLES_SYSTEM=1"):
        check_worker_environment(str(lacking))
    check_worker_environment(str(having))
    check_worker_environment(sys.executable)
    source = os.path.dirname(os.path.dirname(os.path.abspath(slime_ext.__file__)))
    uv = "uv run --locked --extra mcore --directory /rl"
    with caplog.at_level(logging.WARNING, logger="slime_ext.integrations.nemo_rl"):
        check_worker_environment(uv, {"PYTHONPATH": source})
        assert not caplog.records
        check_worker_environment(uv, {})
    assert "PYTHONPATH holds none" in caplog.text
    with pytest.raises(NemoRLSettingError, match="cannot import slime-ext's worker class") as raised:
        with missing_slime_ext_named(True):
            raise ModuleNotFoundError("No module named 'slime_ext'")
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)
    for active, error in ((False, ModuleNotFoundError("No module named 'slime_ext'")), (True, KeyError("x"))):
        with pytest.raises(type(error)):
            with missing_slime_ext_named(active):
                raise error


def test_unpadded_pack_parameters_drop_only_the_pad_to_the_longest():
    from slime_ext.integrations.nemo_rl.worker import unpadded_pack_parameters

    wrapped = unpadded_pack_parameters(lambda cfg, pad, longest: (pad, 16, longest))
    assert wrapped({}, 8, 4096) == (8, 16, None)
