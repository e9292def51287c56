"""Runs slime-ext inside one real slime tree and prints what happened as JSON (one process per slime revision,
since slime's modules are process-wide). The host tests (``test_slime_*.py``) start it and check the JSON.

    python tests/hosts/slime_probe.py ledger --case multi_sample      (slime's tree and Megatron on PYTHONPATH)

Scenarios:

* ``ledger --case NAME``: real ``RolloutManager._split_train_data_by_dp`` (patched in this "driver" by
  ``slime_ext.integrations.slime.enable()``, exactly as Ray would ship it) -> real ``process_rollout_data`` ->
  the trainer's real ``get_data_iterator`` / ``DataIterator`` (v0.2.4: the actor's bound name, switched by
  slime-ext's ``megatron_init`` hook). Every micro-batch each rank's iterators yield is recorded.
* ``revision``: which revision slime-ext detected, and the patches it applied.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_stubs  # noqa: E402

gpu_stubs.install()

#: ledger cases: rollouts as sample lengths, plus the parallel layout and flags
CASES = {
    # one sample per rollout, dynamic batches, balance_data, 2 steps, 1 trailing rollout trimmed
    "one_sample": dict(rollouts=[[37], [120], [64], [15], [90], [33], [250], [18], [77]], dp=2, gbs=4,
                       dynamic=True, max_tokens=256, balance_data=True),
    # compact / subagent style: rollouts emit 1..4 samples; groups must stay whole; tail trimmed
    "multi_sample": dict(rollouts=[[40, 22, 61], [80], [12, 13], [200, 5, 9, 30], [70, 70], [44], [150, 3],
                                   [66, 10, 10], [25]], dp=2, gbs=2, dynamic=True, max_tokens=200,
                         balance_data=True),
    # VPP=2 (micro-batches per rank a multiple of microbatch_group_size_per_vp_stage=2)
    "vpp2": dict(rollouts=[[30 + 7 * i] for i in range(16)], dp=2, gbs=8, dynamic=True, max_tokens=128,
                 balance_data=False, vpp=2, mb_group=2),
    # CP=2: the cap is max_tokens_per_gpu * cp_size; a sample above it sits alone
    "cp2": dict(rollouts=[[300], [40], [90, 60], [20], [110], [75], [130], [55]], dp=2, gbs=4, dynamic=True,
                max_tokens=100, balance_data=True, cp=2),
    # static micro-batches of 2 samples
    "static": dict(rollouts=[[10 + 3 * i] for i in range(16)], dp=2, gbs=8, dynamic=False, mbs=2,
                   balance_data=True),
    # issue 16: --use-dynamic-global-batch-size counts samples: three rollouts of four samples fill dp = 4 (they
    # were refused with "lower --global-batch-size to at most 3"); --global-batch-size 8 is ignored
    "dynamic_gbs": dict(rollouts=[[50 + i] * 4 for i in range(3)], dp=4, gbs=8, dynamic=True, max_tokens=4096,
                        balance_data=True, dyn_gbs=True),
    # five rollouts of three samples at dp = 4: slime v0.2.4 keeps 12 of the 15 samples (its sample rounding),
    # slime-ext there the four whole rollouts inside 12; later slime has no such flag: every rollout is kept
    "dynamic_gbs_round": dict(rollouts=[[40 + i] * 3 for i in range(5)], dp=4, gbs=8, dynamic=True,
                              max_tokens=4096, balance_data=False, dyn_gbs=True),
    # issue 16: samples whose Sample.index (the rollout id slime hands the split) is None: each is its own
    # rollout, never merged; with gbs = 2, 16 rollouts make 8 steps of 2 samples
    "none_index": dict(rollouts=[[20 + i] for i in range(16)], ids=[None] * 8 + list(range(8)), dp=2, gbs=2,
                       dynamic=True, max_tokens=256, balance_data=True),
    "all_none_index": dict(rollouts=[[20 + i] for i in range(16)], ids=[None] * 16, dp=2, gbs=2, dynamic=True,
                           max_tokens=256, balance_data=True),
}


def make_args(case: dict, *, revision: str) -> SimpleNamespace:
    return SimpleNamespace(
        dp_schedule="rollout", global_batch_size=case["gbs"], micro_batch_size=case.get("mbs", 1),
        use_dynamic_batch_size=case["dynamic"], max_tokens_per_gpu=case.get("max_tokens"),
        balance_data=case["balance_data"], balance_by_flops=False,
        use_dynamic_global_batch_size=case.get("dyn_gbs", False),
        disable_rollout_trim_samples=False, context_parallel_size=case.get("cp", 1),
        virtual_pipeline_model_parallel_size=case.get("vpp"), microbatch_group_size_per_vp_stage=case.get("mb_group"),
        pipeline_model_parallel_size=2 if case.get("vpp") else 1,
        hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=4, kv_channels=16, ffn_hidden_size=256,
        vocab_size=1000, num_experts=None, swiglu=False, use_wandb=False, use_tensorboard=False,
        custom_megatron_init_path=None, qkv_format="thd",
    )


def train_data(case: dict, revision: str) -> tuple[dict, list[int]]:
    """slime's train data for the case. tokens of sample ``i`` are all ``i``, so the trainer side can tell which
    sample a micro-batch holds from its tokens alone."""
    tokens, rollout_of = [], []
    for rid, lengths in enumerate(case["rollouts"]):
        for length in lengths:
            tokens.append([len(tokens)] * length)
            rollout_of.append(rid)
    n = len(tokens)
    ids = case.get("ids", rollout_of)  # what slime hands the split: Sample.index (v0.2.4), group/rollout ids later
    data = {"tokens": tokens, "response_lengths": [max(1, len(t) // 2) for t in tokens],
            "rewards": [float(i % 3) for i in range(n)], "raw_reward": [float(i % 3) for i in range(n)],
            "truncated": [0] * n, "loss_masks": [[1] * max(1, len(t) // 2) for t in tokens]}
    if revision == "0.2.4":
        data["sample_indices"] = list(ids)  # Sample.index: one id per rollout
    elif revision == "0.3.0":
        data["sample_indices"] = list(range(n))
        data["group_ids"] = list(ids)
        data["group_mask_sums"] = [1.0] * n
    else:
        data["sample_indices"] = list(range(n))
        data["rollout_ids"] = list(ids)
    return data, rollout_of


_records: list[str] = []


class _Capture(logging.Handler):
    def emit(self, record):
        _records.append(record.getMessage())


def run_ledger(case_name: str) -> dict:
    import ray

    from slime_ext.integrations import slime as integration
    from slime_ext.integrations.slime import planner
    from slime_ext.patches import slime_host

    records = _records
    records.clear()
    log = logging.getLogger("slime_ext.integrations.slime")
    if not any(isinstance(h, _Capture) for h in log.handlers):
        log.addHandler(_Capture())
    log.setLevel(logging.INFO)

    integration.enable()  # the driver: patches slime's RolloutManager before it would be shipped
    import slime.ray.rollout as rollout_module
    from slime.utils.data import process_rollout_data

    revision = slime_host.detect_revision()
    case = CASES[case_name]
    args = make_args(case, revision=revision.version)
    data, rollout_of = train_data(case, revision.version)
    n = len(rollout_of)
    lengths = [len(t) for t in data["tokens"]]
    dp = case["dp"]

    manager_cls = slime_host.rollout_manager_classes(rollout_module)[0]  # the class Ray ships
    manager = object.__new__(manager_cls)
    manager.args, manager.rollout_id = args, 0
    manager.train_parallel_config = {"dp_size": dp, "cp_size": case.get("cp", 1), "vpp_size": case.get("vpp") or 1,
                                     "microbatch_group_size_per_vp_stage": case.get("mb_group") or 1}
    if not ray.is_initialized():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    if revision.version == "0.2.4":
        refs = manager._split_train_data_by_dp(data, dp)
    else:
        refs = manager._split_train_data_by_dp(data)
    per_rank = [process_rollout_data(args, refs, r, dp) for r in range(dp)]

    from megatron.core import parallel_state as mpu

    vpp = case.get("vpp") or 1
    mpu.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    data_module = __import__("slime.backends.megatron_utils.data", fromlist=["x"])
    if revision.plans_on_train_side:
        integration.megatron_init(args)  # what slime's train actor runs through --custom-megatron-init-path
        try:
            trainer_module = __import__("slime.backends.megatron_utils.actor", fromlist=["x"])
            bound = "slime.backends.megatron_utils.actor.get_data_iterator"
        except ImportError:  # no Megatron-LM source: megatron.training is missing, use the defining module
            trainer_module, bound = data_module, "slime.backends.megatron_utils.data.get_data_iterator"

        def iterators_of(rollout_data):
            return trainer_module.get_data_iterator(args, None, rollout_data)
    else:
        bound = "slime.backends.megatron_utils.data.get_data_iterator"

        def iterators_of(rollout_data):
            return data_module.get_data_iterator(rollout_data), list(rollout_data["num_microbatches"])

    ranks = []
    for r, rollout_data in enumerate(per_rank):
        iterators, num_mbs = iterators_of(rollout_data)
        stages = []
        for it in iterators:
            steps = []
            for count in num_mbs:
                mbs = []
                for _ in range(count):
                    batch = it.get_next(["tokens", "total_lengths"])
                    mbs.append([int(t[0]) for t in batch["tokens"]])
                steps.append(mbs)
            stages.append(steps)
        from slime_ext.integrations.slime.trainer import step_sizes

        sizes = step_sizes(iterators)
        ranks.append({"num_microbatches": num_mbs, "stages": stages, "vpp_iterators": len(iterators),
                      "keys_seen_by_slime": sorted(rollout_data), "samples_per_step": sizes,
                      "global_batch_sizes": rollout_data.get("global_batch_sizes")})
    report = planner.last_report
    slime_v024_samples = None  # slime v0.2.4's own --use-dynamic-global-batch-size sample count (its real method)
    if revision.version == "0.2.4" and case.get("dyn_gbs"):
        slime_v024_samples = manager._compute_dynamic_global_batch_size(n)
    return {"revision": revision.version, "case": case_name, "dyn_gbs": case.get("dyn_gbs", False),
            "slime_v024_samples": slime_v024_samples, "n": n, "lengths": lengths, "rollout_of": rollout_of,
            "dp": dp, "cap": case["max_tokens"] * case.get("cp", 1) if case["dynamic"] else None,
            "gbs": case["gbs"], "vpp": vpp, "mb_group": case.get("mb_group") or 1, "bound": bound, "ranks": ranks,
            "report": None if report is None else report.__dict__ | {"num_microbatches": list(report.num_microbatches)},
            "log": list(records)}


#: the log-prob cases: a ledger case, and the log-prob cap set apart from its --max-tokens-per-gpu
LOG_PROB_CASES = {"multi_sample": 2, "vpp2": 3}


def run_log_probs(case_name: str) -> dict:
    """slime's log-prob passes for one ledger case, through slime's real ``MegatronTrainRayActor.compute_log_prob``
    (patched in this "train actor" by slime-ext's ``megatron_init`` hook) with slime's ``forward_only`` replaced by a
    recorder of what the iterators it is handed yield. Three runs: ``--log-probs-max-tokens-per-gpu`` unset (slime
    sets it to ``--max-tokens-per-gpu``) before the patch exists, set apart, unset again through the patch. The DP
    ranks' agreement (an all-reduce in a real job) is played out over the ranks of this process."""
    from slime_ext.integrations import slime as integration
    from slime_ext.integrations.slime import log_probs
    from slime_ext.patches import slime_host

    integration.enable()
    import slime.ray.rollout as rollout_module
    from slime.utils.data import process_rollout_data

    try:
        actor_module = __import__("slime.backends.megatron_utils.actor", fromlist=["x"])
    except ImportError as exc:
        return {"skip": f"slime's trainer needs megatron.training (set MEGATRON_LM_GIT): {exc}"}
    data_module = __import__("slime.backends.megatron_utils.data", fromlist=["x"])
    import ray
    from megatron.core import parallel_state as mpu

    revision = slime_host.detect_revision()
    case = CASES[case_name]
    args = make_args(case, revision=revision.version)
    data, _ = train_data(case, revision.version)
    dp, vpp = case["dp"], case.get("vpp") or 1
    manager = object.__new__(slime_host.rollout_manager_classes(rollout_module)[0])
    manager.args, manager.rollout_id = args, 0
    manager.train_parallel_config = {"dp_size": dp, "cp_size": case.get("cp", 1), "vpp_size": vpp,
                                     "microbatch_group_size_per_vp_stage": case.get("mb_group") or 1}
    if not ray.is_initialized():
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    refs = manager._split_train_data_by_dp(data, dp) if revision.version == "0.2.4" else \
        manager._split_train_data_by_dp(data)
    mpu.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    calls: list = []

    def recorder(f, args_, model, data_iterator, num_microbatches, store_prefix="", **kwargs):
        stages = []
        for it in data_iterator:
            it.reset()
            stages.append([[[int(t[0]) for t in it.get_next(["tokens"])["tokens"]] for _ in range(count)]
                           for count in num_microbatches])
        calls.append({"prefix": store_prefix, "counts": list(num_microbatches), "stages": stages,
                      "order": [i for mb in data_iterator[0].micro_batch_indices for i in mb]})
        return {}

    actor_module.forward_only = recorder  # what slime's compute_log_prob calls, by its module-global name

    def rank_runs(answers):
        """Every rank's two passes (reference, then actor), each all-reduce answered from ``answers``."""
        out, asked = [], []
        for r in range(dp):
            rollout_data = process_rollout_data(args, refs, r, dp)
            if revision.plans_on_train_side:
                iterators, counts = actor_module.get_data_iterator(args, None, rollout_data)
            else:
                iterators, counts = data_module.get_data_iterator(rollout_data), list(rollout_data["num_microbatches"])
            training = [[[int(rollout_data["tokens"][i][0]) for i in mb] for mb in iterators[0].micro_batch_indices]]
            given = iter(answers)
            asked.append([])
            log_probs.agree_over_dp = lambda value, op, mine=asked[-1], given=given: (mine.append(value),
                                                                                     next(given))[1]
            actor = object.__new__(actor_module.MegatronTrainRayActor)
            actor.args, actor.model = args, None
            calls.clear()
            for prefix in ("ref_", ""):
                actor.compute_log_prob(iterators, counts, store_prefix=prefix)
            out.append({"training": training[0], "training_counts": list(counts), "passes": list(calls),
                        "local_samples": len(rollout_data["tokens"])})
        return out, asked

    def agreed_runs():
        _, asked = rank_runs([10**9, 10**9, 0])  # what every rank puts in
        most, fewest = max(a[0] for a in asked), min(a[1] for a in asked)
        _, asked = rank_runs([most, fewest, 0])
        return rank_runs([most, fewest, max(a[2] for a in asked)])[0]

    if revision.plans_on_train_side:
        integration.megatron_init(args)  # the train-side schedule (v0.2.4)
    cap = case["max_tokens"] * LOG_PROB_CASES[case_name]
    args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu  # slime's default: unset
    integration.megatron_init(args)
    before = rank_runs([])[0]
    patched_before = "log_probs" in integration._applied
    args.log_probs_max_tokens_per_gpu = cap
    integration._applied.pop("log_probs", None)
    integration.megatron_init(args)  # the hook sees the cap set apart: the log-prob patch is applied
    apart = agreed_runs()
    target = integration._applied["log_probs"].patches[0].target
    args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu
    after = rank_runs([])[0]
    integration._applied.pop("log_probs").undo()
    return {"revision": revision.version, "case": case_name, "cap": cap * case.get("cp", 1), "vpp": vpp,
            "mb_group": case.get("mb_group") or 1, "lengths": [len(t) for t in data["tokens"]],
            "unset": before, "unset_patched": patched_before, "apart": apart, "unset_through_patch": after,
            "target": target}


def slime_args(**megatron) -> argparse.Namespace:
    """slime's own defaults for every slime flag (its real parser, with slime-ext's options joined as the launcher
    joins them), plus the Megatron flags slime reads off the same namespace."""
    from slime.utils import arguments

    from slime_ext.integrations import slime as integration

    integration.enable()  # slime's provider now adds slime-ext's options after slime's own, as in the launcher
    parser = argparse.ArgumentParser(allow_abbrev=False)
    with gpu_stubs.inert_calls():
        parser = arguments.get_slime_extra_args_provider()(parser)
    args, _ = parser.parse_known_args(["--rollout-batch-size", "9", "--debug-train-only",
                                       "--rollout-function-path", "slime_fixtures.generate",
                                       "--eval-function-path", "slime_fixtures.generate",
                                       "--data-source-path", "slime_fixtures.TinyDataSource"])
    base = dict(global_batch_size=2, micro_batch_size=1, context_parallel_size=1, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, microbatch_group_size_per_vp_stage=None,
                hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=4, kv_channels=16,
                ffn_hidden_size=256, vocab_size=1000, num_experts=None, swiglu=False, use_wandb=False,
                use_tensorboard=False, use_dynamic_batch_size=True, max_tokens_per_gpu=200, balance_data=True)
    for key, value in {**base, **megatron}.items():
        setattr(args, key, value)
    # the flags slime pre-parses apart (slime.utils.arguments._pre_parse_mode), as `--debug-train-only` sets them
    for key, value in dict(debug_train_only=True, debug_rollout_only=False, load_debug_rollout_data=None,
                           train_backend="megatron").items():
        if not hasattr(args, key):
            setattr(args, key, value)
    integration._finish(args)
    return args


def run_actor() -> dict:
    """A real Ray actor: slime's RolloutManager, patched in this driver and shipped by Ray, generates a rollout
    (slime_fixtures), converts it with slime's own code and splits it; the driver reads the payloads back."""
    import ray

    from slime_ext.integrations import slime as integration
    from slime_ext.patches import slime_host

    integration.enable()
    import slime.ray.rollout as rollout_module
    from slime.utils.data import process_rollout_data

    import slime_fixtures

    import tempfile

    revision = slime_host.detect_revision()
    args = slime_args(use_tensorboard=True, tb_project_name="slime-ext-host", tb_experiment_name="actor")
    dp = 2
    here = str(Path(__file__).resolve().parent)
    tb_dir = tempfile.mkdtemp(prefix="slime-ext-tb-")
    env = {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]), "RAY_AUTH_MODE": "disabled",
           "TENSORBOARD_DIR": tb_dir}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True, configure_logging=False,
             runtime_env={"env_vars": env, "worker_process_setup_hook": "gpu_stubs.install"})
    try:
        manager = rollout_module.RolloutManager.options(num_cpus=0, num_gpus=0).remote(args, None)
        ray.get(manager.set_train_parallel_config.remote(
            {"dp_size": dp, "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}))
        actor_pid = ray.get(manager.__ray_call__.remote(slime_fixtures.capture_log))
        refs = ray.get(manager.generate.remote(0))
        per_rank = [process_rollout_data(args, refs, r, dp) for r in range(dp)]
        in_actor = ray.get(manager.__ray_call__.remote(slime_fixtures.captured_log))
        ray.get(manager.__ray_call__.remote(slime_fixtures.close_tensorboard))  # slime's writer never flushes
    finally:
        ray.shutdown()
    metrics = slime_fixtures.read_tensorboard(tb_dir)
    lengths = [n for r in slime_fixtures.ROLLOUTS for n in r]
    rollout_of = [rid for rid, r in enumerate(slime_fixtures.ROLLOUTS) for _ in r]
    ranks = []
    for rollout_data in per_rank:
        if revision.plans_on_train_side:
            sched = rollout_data["slime_ext_schedule"]
            mbi, num_mbs, sizes = sched["micro_batch_indices"], sched["num_microbatches"], sched["samples_per_step"]
        else:
            mbi, num_mbs, sizes = rollout_data["micro_batch_indices"], rollout_data["num_microbatches"], None
        mbs = [[int(rollout_data["tokens"][i][0]) for i in mb] for mb in mbi]
        steps, k = [], 0
        for count in num_mbs:
            steps.append(mbs[k:k + count])
            k += count
        ranks.append({"num_microbatches": num_mbs, "stages": [steps], "vpp_iterators": 1, "samples_per_step": sizes,
                      "keys_seen_by_slime": [], "global_batch_sizes": rollout_data.get("global_batch_sizes")})
    kept = sum(len(mb) for r in ranks for s in r["stages"][0] for mb in s)
    dropped = len(lengths) - kept
    return {"revision": revision.version, "case": "actor", "n": len(lengths), "lengths": lengths,
            "rollout_of": rollout_of, "dp": dp, "cap": 200, "gbs": 2, "vpp": 1, "mb_group": 1, "ranks": ranks,
            "report": {"dropped_samples": dropped, "num_steps": len(ranks[0]["num_microbatches"])},
            "log": in_actor["log"], "metrics": metrics, "actor_pid": actor_pid, "driver_pid": os.getpid(),
            "in_actor": in_actor}


def run_revision() -> dict:
    from slime_ext.integrations import slime as integration
    from slime_ext.patches import slime_host

    integration.enable()
    import slime.ray.rollout  # noqa: F401  (patched on import)

    revision = slime_host.detect_revision()
    applied = integration._applied["rollout"]
    return {"revision": revision.version, "ids_keyword": revision.ids_keyword,
            "patches": [p.target for p in applied.patches], "describe": applied.describe()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["ledger", "revision", "actor", "log_probs", "all"])
    parser.add_argument("--case", choices=sorted(CASES), default="one_sample")
    ns = parser.parse_args()
    if ns.scenario == "ledger":
        out = run_ledger(ns.case)
    elif ns.scenario == "revision":
        out = run_revision()
    elif ns.scenario == "actor":
        out = run_actor()
    elif ns.scenario == "log_probs":
        out = {name: run_log_probs(name) for name in LOG_PROB_CASES}
    else:  # everything for this slime tree in one process
        out = {"revision": run_revision(), "ledgers": {name: run_ledger(name) for name in CASES}}
        import ray

        ray.shutdown()
    print("SLIME_PROBE_JSON " + json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main()
