"""slime-ext through NeMo-RL's own code: its ``Policy._shard_for_train`` / ``_shard_for_logprob`` and
``BatchedDataDict.shard_by_batch_size`` on the driver, its ``get_batch``, micro-batch iterators and Megatron
``get_microbatch_iterator`` on the worker side, with the switch on and off.

``Policy.__init__`` is not run (it starts Ray workers on GPUs): :func:`make_policy` sets the attributes NeMo-RL's
sharding reads, as ``__init__`` sets them, and the layout as slime-ext's ``__init__`` patch sets it.
"""

from __future__ import annotations

import pytest

from nemo_rl_fixtures import CAP_LOGPROB, CAP_TRAIN, PAD, make_policy, policy_config, rollouts


@pytest.fixture
def switch():
    """slime-ext enabled (its defaults) for one test, undone after it."""
    from slime_ext.integrations import nemo_rl as integration

    integration.enable()
    yield integration
    integration.disable()


@pytest.fixture
def padded_switch():
    """slime-ext enabled with the pad_to_longest opt-out for one test, undone after it."""
    from slime_ext.integrations import nemo_rl as integration

    integration.enable(pad_to_longest=True)
    yield integration
    integration.disable()


def rows_of(batch) -> list[int]:
    return [int(row[0]) - 1 for row in batch["input_ids"]]


def check_shards(shards, lengths, batch_size, cap):
    """Every row once, each global batch's rows on the ranks, the same micro-batch count on every rank per global
    batch, lengths as NeMo-RL's worker packs them, the cap held by every micro-batch of several rows."""
    seen = [i for shard in shards for i in rows_of(shard)]
    assert sorted(seen) == list(range(len(lengths)))
    num_gb = len(lengths) // batch_size
    for shard in shards:
        assert len(shard.micro_batch_indices) == len(shard.elem_counts_per_gb) == num_gb
    for g in range(num_gb):
        counts = {len(shard.micro_batch_indices[g]) for shard in shards}
        assert len(counts) == 1, f"global batch {g}: micro-batch counts {counts} differ between ranks"
        for shard in shards:
            gb = shard.get_batch(batch_idx=g)  # NeMo-RL's worker-side slicing by elem_counts_per_gb
            gb_rows = rows_of(gb)
            assert all(i // batch_size == g for i in gb_rows)
            for (start, end), tokens in zip(gb.micro_batch_indices[0], gb.micro_batch_lengths[0], strict=True):
                padded = [-(-lengths[i] // PAD) * PAD for i in gb_rows[start:end]]
                assert tokens == sum(padded)
                assert end - start == 1 or tokens <= cap


@pytest.mark.parametrize("pad_to_longest", [False, True])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("dp", [2, 4])
def test_shard_for_train_switch_on_and_off(dp, pp, pad_to_longest):
    """Switch on: slime-ext's plan through NeMo-RL's real ``_shard_for_train``; off: NeMo-RL's own. Both hold the
    invariants; on, the shards are the plan slime-ext made (the last plan of the runtime): by default planned
    without the pad (the workers run each micro-batch at its own length), with the ``pad_to_longest`` opt-out at
    PP 2 planned with NeMo-RL's pad priced in, or NeMo-RL's own where the runtime's choice says it is faster."""
    from slime_ext.integrations import nemo_rl as integration
    from slime_ext.integrations.nemo_rl import runtime

    data, lengths = rollouts(64)
    integration.enable(pad_to_longest=pad_to_longest)
    try:
        ours = make_policy(policy_config(pp), dp)._shard_for_train(data, 32)
        plan, choice = runtime.STATE.last_plan, runtime.STATE.last_choice
    finally:
        integration.disable()
    check_shards(ours, lengths, 32, CAP_TRAIN)
    padded = pad_to_longest and pp > 1
    assert plan is not None and not plan.forward_only and plan.schedule.parallel.pp_size == pp
    assert (choice is None) == (not padded) and (plan.padded_time is None) == (not padded)
    assert not padded or (choice.theirs is not None and choice.ours == plan.padded_time)
    theirs = make_policy(policy_config(pp), dp)._shard_for_train(data, 32)
    check_shards(theirs, lengths, 32, CAP_TRAIN)
    if choice is not None and choice.theirs_wins:
        assert [rows_of(s) for s in ours] == [rows_of(s) for s in theirs]
    else:
        assert [rows_of(s) for s in ours] == [list(r) for r in plan.rows]
    assert [rows_of(s) for s in theirs] != [list(r) for r in plan.rows]


@pytest.mark.parametrize("theirs_faster", [False, True])
def test_under_the_pad_to_the_longest_nemo_rls_own_runs_when_faster(padded_switch, theirs_faster, monkeypatch):
    """At PP 2 with the opt-out (NeMo-RL's worker pads to the longest) the runtime prices NeMo-RL's own shards of
    the call; when they are the faster (here the choice is forced, its pricing is tested in tests/unit), they come
    back unchanged, rows and metadata, else slime-ext's plan."""
    from slime_ext.integrations.nemo_rl import runtime
    from slime_ext.integrations.nemo_rl.plan import PaddedChoice

    seen = []

    def forced(ours, theirs, lengths, **kwargs):
        seen.append((ours, theirs))
        return PaddedChoice(2.0, 1.0 if theirs_faster else 3.0)

    monkeypatch.setattr(runtime, "choose_padded", forced)
    data, lengths = rollouts(64, seed=7)
    shards, sorted_indices = make_policy(policy_config(pp=2), 2)._shard_for_logprob(data)
    plan = runtime.STATE.last_plan
    padded_switch.disable()
    own, own_sorted = make_policy(policy_config(pp=2), 2)._shard_for_logprob(data)
    assert len(seen) == 1 and plan.padded_time is not None and seen[0][0] == plan.padded_time  # priced once: made
    assert seen[0][1] == [[[rows_of(own[r])[s:e] for s, e in own[r].micro_batch_indices[0]] for r in range(2)]]
    metadata = [(rows_of(s), s.micro_batch_indices, s.micro_batch_lengths, s.elem_counts_per_gb) for s in shards]
    if theirs_faster:
        assert sorted_indices == own_sorted
        assert metadata == [(rows_of(s), s.micro_batch_indices, s.micro_batch_lengths, s.elem_counts_per_gb)
                            for s in own]
    else:
        assert sorted_indices == plan.sorted_indices and [m[0] for m in metadata] == [list(r) for r in plan.rows]


def test_a_row_over_the_cap_is_planned_where_nemo_rls_packer_refuses_it(padded_switch):
    """NeMo-RL's packer refuses a row longer than the cap; slime-ext's plan puts it alone in a micro-batch, so at PP 2
    with the opt-out NeMo-RL's own plan is no candidate and slime-ext's runs."""
    from slime_ext.integrations.nemo_rl import runtime

    data, lengths = rollouts(64, seed=5, longest=700)
    assert max(lengths) > CAP_TRAIN
    shards = make_policy(policy_config(pp=2), 2)._shard_for_train(data, 32)
    check_shards(shards, lengths, 32, CAP_TRAIN)
    choice = runtime.STATE.last_choice
    assert choice.theirs is None and "exceeds bin capacity" in choice.why_not and not choice.theirs_wins
    assert [rows_of(s) for s in shards] == [list(r) for r in runtime.STATE.last_plan.rows]


@pytest.mark.parametrize("dp", [2, 4])
def test_shard_for_logprob_forward_only_and_order_restored(switch, dp):
    """The log-prob path plans a forward-only pass under logprob_mb_tokens, and NeMo-RL's own ``reorder_data``
    puts the workers' outputs back in the batch's order."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from slime_ext.integrations.nemo_rl import runtime

    data, lengths = rollouts(48, seed=3)
    policy = make_policy(policy_config(pp=2), dp)
    shards, sorted_indices = policy._shard_for_logprob(data)
    check_shards(shards, lengths, len(lengths), CAP_LOGPROB)
    assert runtime.STATE.last_plan.forward_only and runtime.STATE.last_plan.cap == CAP_LOGPROB
    outputs = BatchedDataDict.from_batches([{"logprobs": shard["input_ids"][:, :1].float()} for shard in shards])
    outputs.reorder_data(sorted_indices)
    assert [int(x) - 1 for x in outputs["logprobs"][:, 0]] == list(range(len(lengths)))


def test_other_shard_calls_are_nemo_rls_own(switch):
    """Outside the two Policy methods, ``shard_by_batch_size`` is NeMo-RL's own even with the switch on."""
    from slime_ext.integrations.nemo_rl import runtime

    data, _ = rollouts(16)
    runtime.STATE.last_plan = None
    args = {"max_tokens_per_microbatch": CAP_TRAIN, "input_key": "input_ids", "input_lengths_key": "input_lengths",
            "algorithm": "modified_first_fit_decreasing", "sequence_length_pad_multiple": PAD}
    data.shard_by_batch_size(2, batch_size=8, sequence_packing_args=args)
    assert runtime.STATE.last_plan is None


@pytest.mark.parametrize("pad_to_longest", [False, True])
@pytest.mark.parametrize("pp", [1, 2])
def test_worker_iterators_run_every_row_once(pp, pad_to_longest, monkeypatch):
    """NeMo-RL's worker side on our shards: ``get_batch`` per global batch, its Megatron ``get_microbatch_iterator``
    (packing; under PP by default with slime-ext's worker patch, each packed micro-batch at its own length, and with
    the opt-out NeMo-RL's pad to the longest) and the processed micro-batches: every row once per step, the counts
    the shards announce."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.megatron.data import get_microbatch_iterator

    from slime_ext.integrations import nemo_rl as integration

    monkeypatch.setattr(BatchedDataDict, "to", lambda self, device: self)  # the CPU host: no .to("cuda")
    data, lengths = rollouts(32, seed=5)
    cfg = policy_config(pp)
    integration.enable(pad_to_longest=pad_to_longest)
    try:
        shards = make_policy(cfg, 2)._shard_for_train(data, 16)
    finally:
        integration.disable()
    if pp > 1 and not pad_to_longest:
        integration.enable_worker()  # what slime-ext's worker class applies in its processes
    try:
        for g in range(2):
            counts = set()
            for shard in shards:
                batch = shard.get_batch(batch_idx=g)
                iterator, count, mbs, _, padded = get_microbatch_iterator(batch, cfg, 1, straggler_timer=None)
                counts.add(count)
                seen, widths = [], []
                for processed in iterator:
                    ids = processed.input_ids.flatten().tolist()
                    seen += sorted({i - 1 for i in ids if i > 0})
                    widths.append(processed.input_ids.shape[-1])
                assert sorted(seen) == sorted(rows_of(batch))
                assert mbs == 1
                if pp > 1 and pad_to_longest:
                    assert widths == [padded] * count and padded == max(batch.micro_batch_lengths[0])
                else:
                    assert widths == list(batch.micro_batch_lengths[0])
            assert len(counts) == 1
    finally:
        integration.disable()


def test_refuses_an_unknown_nemo_rl(monkeypatch):
    """A NeMo-RL outside the supported range is refused before anything is patched, naming the range."""
    import nemo_rl.package_info as info
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from slime_ext.integrations import nemo_rl as integration
    from slime_ext.patches import PatchError

    original = BatchedDataDict.shard_by_batch_size
    monkeypatch.setattr(info, "__version__", "0.9.0")
    with pytest.raises(PatchError, match=r"supports nemo-rl>=0\.6\.0,<0\.8.*0\.9\.0"):
        integration.enable()
    assert BatchedDataDict.shard_by_batch_size is original and not integration.enabled()


def test_enable_and_disable_restore_nemo_rls_functions():
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.models.policy.lm_policy import Policy

    from slime_ext.integrations import nemo_rl as integration

    before = (BatchedDataDict.shard_by_batch_size, Policy._shard_for_train, Policy._shard_for_logprob,
              Policy.__init__)
    integration.enable()
    try:
        during = (BatchedDataDict.shard_by_batch_size, Policy._shard_for_train, Policy._shard_for_logprob,
                  Policy.__init__)
        assert all(a is not b for a, b in zip(before, during, strict=True))
    finally:
        integration.disable()
    after = (BatchedDataDict.shard_by_batch_size, Policy._shard_for_train, Policy._shard_for_logprob,
             Policy.__init__)
    assert after == before


NEMO_RL_OWN_TESTS = ("tests/unit/distributed/test_batched_data_dict.py", "tests/unit/data/packing/test_algorithms.py")


@pytest.mark.parametrize("switch_on", [False, True], ids=["switch-off", "switch-on"])
def test_nemo_rls_own_tests_pass_with_slime_ext_installed(switch_on):
    """NeMo-RL's own tests of the sharding and the packers, run from its tree in this venv (slime-ext installed);
    with the switch on as well, since outside a Megatron policy's shard methods nothing changes. Run with
    ``--noconftest``: NeMo-RL's ``tests/unit/conftest.py`` starts a Ray cluster and a GPU monitor for every session,
    and these two files use none of its fixtures."""
    import importlib.metadata
    import os
    import subprocess
    import sys

    from conftest import HERE, TREE

    assert importlib.metadata.version("slime-ext")  # installed in this venv, not only on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TREE, HERE]), "NO_VCS_VERSION": "1"}
    plugin = ["-p", "nemo_rl_switch_on"] if switch_on else []
    run = subprocess.run([sys.executable, "-c", "import nemo_rl_stubs; nemo_rl_stubs.install(); import pytest, sys; "
                          "sys.exit(pytest.main(sys.argv[1:]))", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          "--noconftest", *plugin, *NEMO_RL_OWN_TESTS],
                         cwd=TREE, env=env, capture_output=True, text=True, timeout=900)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0, f"NeMo-RL's own tests failed ({summary}):\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    assert " passed" in summary and "failed" not in summary, summary
