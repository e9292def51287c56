"""Real slime training on CPU (gloo, DP=2) on the Megatron-LM commit slime pins, at every supported tag: slime's own
planner against slime-ext's on the same rollouts, compared on the parameters after two steps
(``slime_train_worker.py`` does the work; its module doc lists every place where the run departs from a GPU run of
slime, and why). Without TransformerEngine, slime-ext's integration sets slime's ``--spec`` to its THD layer spec on
both paths, so slime's packed (THD) micro-batches train -- the only format v0.3.1 and HEAD have.

* v0.2.4: slime's split + train-side planning vs slime-ext's rollout-side schedule + its v0.2.4 trainer adapters.
* v0.3.0, v0.3.1, HEAD: slime's own ``build_dp_schedule`` vs slime-ext's, both consumed by slime's trainer.
* every tag: ``--use-dynamic-batch-size --max-tokens-per-gpu 64`` with ``--balance-data`` off and on (two rollouts
  of one step each), and static micro-batches.

    SLIME_GIT=/path/to/slime MEGATRON_LM_GIT=/path/to/Megatron-LM ci/host_test tests/hosts/test_slime_train.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_ext.schemes import upstream

torch = pytest.importorskip("torch")
from slime_ext.training.parallel import host_store, hosted_store_env  # noqa: E402 - after torch's skip

HERE = Path(__file__).resolve().parent
WORKER = HERE / "slime_train_worker.py"
DP = 2


def _load(name: str, path: Path):
    """A module of this folder by path (``conftest`` is ambiguous: tests/ has one too)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_hosts = _load("slime_ext_hosts_conftest", HERE / "conftest.py")
HOW, megatron_tree, slime_tree = _hosts.HOW, _hosts.megatron_tree, _hosts.slime_tree
_git_dir = upstream.git_dir  # the one reader of SLIME_GIT / MEGATRON_LM_GIT
_worker = _load("slime_ext_hosts_train_worker", WORKER)
CASES, LR, WARMUP_ITERS, TAG_CASES = _worker.CASES, _worker.LR, _worker.WARMUP_ITERS, _worker.TAG_CASES
iterations, first_token = _worker.iterations, _worker.first_token
#: slime vs slime-ext, largest absolute parameter difference after two steps: Adam, lr 1e-2 (updates ~1e-2 per
#: parameter), the same samples per step in different micro-batches, so only float summation order differs. Adam
#: divides each coordinate's step by its own gradient scale, so an order-of-summation difference in a gradient near
#: zero moves that coordinate by a visible fraction of lr: measured up to 1.3e-05 (v0.3.1, dynamic, balanced); the
#: bound is 0.5% of the largest update. Adam is blind to a constant loss scale, so the normaliser is checked on its
#: own (what slime's loss_function receives), not through the parameters.
PARAM_TOL = 5e-5


def _env(slime_git: str, tag: str) -> dict:
    if _git_dir("MEGATRON_LM_GIT") is None:
        pytest.skip(f"no Megatron-LM checkout (real slime training needs megatron.training): {HOW}")
    root = slime_tree(slime_git, tag)
    megatron = megatron_tree(root)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(megatron), str(repo)]),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    return env


_ENVS: dict = {}


def _tag_env(slime_git: str, tag: str) -> dict:
    if tag not in _ENVS:
        _ENVS[tag] = _env(slime_git, tag)
    return _ENVS[tag]


@pytest.fixture(scope="module")
def v024_env(slime_git) -> dict:
    return _tag_env(slime_git, "v0.2.4")


def _run(cmd: list[str], env: dict, timeout: int = 1500) -> None:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[1:4])} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _train(env: dict, case: str, path: str, out: Path, tag: str) -> list[dict]:
    """Two gloo ranks of the worker's ``train`` phase; their results, by rank."""
    store = host_store()  # served here, on a port bound before the ranks learn it; they join as clients
    procs = []
    for rank in range(DP):
        rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(DP), "LOCAL_RANK": str(rank),
                    **hosted_store_env(store)}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "train", "--case", case, "--path", path,
                                       "--out", str(out), "--tag", tag], env=rank_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=1800)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{path} training did not finish in 30 min")
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        if proc.returncode != 0:
            pytest.fail(f"{path} rank {rank} failed ({proc.returncode}):\n{log[-8000:]}")
    return [torch.load(out / f"{path}-result-rank{r}.pt", weights_only=False) for r in range(DP)]


_RESULTS: dict = {}


def _case(env: dict, tmp_path_factory, case: str, tag: str = "v0.2.4") -> dict:
    """``{"slime": [rank results], "ext": [rank results]}``: both paths trained on the case's data (once)."""
    if (tag, case) not in _RESULTS:
        out = tmp_path_factory.mktemp(f"{tag}-{case}")
        _run([sys.executable, str(WORKER), "prepare", "--case", case, "--out", str(out), "--tag", tag], env)
        _RESULTS[tag, case] = {path: _train(env, case, path, out, tag) for path in ("slime", "ext")}
    return _RESULTS[tag, case]


@pytest.fixture(scope="module", params=TAG_CASES["v0.2.4"])
def case_run(request, v024_env, tmp_path_factory) -> tuple[str, dict]:
    return request.param, _case(v024_env, tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def one_sample(v024_env, tmp_path_factory) -> dict:
    return _case(v024_env, tmp_path_factory, "one_sample")


@pytest.fixture(scope="module")
def multi_sample(v024_env, tmp_path_factory) -> dict:
    return _case(v024_env, tmp_path_factory, "multi_sample")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _samples(case: str) -> list[int]:
    return [len(r) for it in iterations(CASES[case]) for r in it]


def _warmup_lr(num_steps: int, gbs: int) -> float:
    """Megatron's linear warmup from ``LR / 2`` over ``WARMUP_ITERS * global_batch_size`` samples, at the scheduler's
    sample counter ``num_steps`` (the LR the next step would use)."""
    return LR / 2 + (LR - LR / 2) * num_steps / (WARMUP_ITERS * gbs)


def test_both_paths_ran_slimes_trainer(case_run):
    case, paths = case_run
    if True:
        for r in range(DP):
            slime, ext = paths["slime"][r], paths["ext"][r]
            assert not slime["get_data_iterator_replaced"] and not slime["train_one_step_wrapped"]
            assert ext["get_data_iterator_replaced"], "slime-ext's megatron_init did not switch get_data_iterator"
            assert ext["train_one_step_wrapped"], "slime-ext's megatron_init did not wrap train_one_step"
            assert ext["samples_per_step"] is not None, "slime-ext's get_data_iterator did not consume the schedule"
            assert slime["args"]["transformer_impl"] == "local" and not slime["args"]["bf16"]
            for path in (slime, ext):  # no TE here: slime-ext's integration gave slime its THD layer spec
                assert path["spec"] == ["slime_ext.training.thd_attention", "slime_layer_spec"]
                assert path["core_attention"] == ["ThdDotProductAttention"]
            assert len(ext["num_microbatches"]) == 2
            assert len(slime["num_microbatches"]) == slime["local_samples"] // (CASES[case]["gbs"] // DP)
            # slime's all-reduced/planned counts: every rank runs the same number of micro-batches per step
            assert paths["ext"][0]["num_microbatches"] == ext["num_microbatches"]
            assert paths["slime"][0]["num_microbatches"] == slime["num_microbatches"]
        # DP replicas agree after the step (DDP all-reduced the gradients), and training moved them
        for path in ("slime", "ext"):
            assert _max_diff(paths[path][0]["params"], paths[path][1]["params"]) == 0.0
            assert _max_diff(paths[path][0]["initial_params"], paths["slime"][0]["initial_params"]) == 0.0
            moved = _max_diff(paths[path][0]["params"], paths[path][0]["initial_params"])
            print(f"{case}/{path}: max |update| over 2 steps = {moved:.3e}")
            assert moved > 1e-3


def test_one_sample_rollouts_match_slimes_own_path(one_sample):
    """One sample per rollout, nothing trimmed: the same samples per step, the same LR increment (8 samples) and
    loss normaliser (8); only the micro-batch grouping differs, so the parameters agree up to float reordering."""
    slime, ext = one_sample["slime"], one_sample["ext"]
    gbs = CASES["one_sample"]["gbs"]
    assert ext[0]["samples_per_step"] == [gbs, gbs]
    for r in range(DP):
        assert slime[r]["scheduler_num_steps"] == ext[r]["scheduler_num_steps"] == 2 * gbs
        assert ext[r]["lr"] == pytest.approx([_warmup_lr(2 * gbs, gbs)] * len(ext[r]["lr"]))
        assert {c["dynamic_global_batch_size"] for c in ext[r]["loss_calls"]} == {gbs}
        assert {c["dynamic_global_batch_size"] for c in slime[r]["loss_calls"]} == {None}  # args.global_batch_size
    diff = _max_diff(slime[0]["params"], ext[0]["params"])
    print(f"PARAM_DIFF v0.2.4/one_sample: max |slime - slime-ext| over all parameters after 2 steps = {diff:.3e}")
    assert diff < PARAM_TOL


def test_multi_sample_rollouts_step_by_samples(multi_sample):
    """Rollouts of 1..3 samples stay whole, so slime-ext's steps hold the samples of 4 rollouts each: the LR
    scheduler advances by exactly those samples and slime's loss_function normalises by them."""
    ext, slime = multi_sample["ext"], multi_sample["slime"]
    per_rollout = _samples("multi_sample")
    gbs = CASES["multi_sample"]["gbs"]
    expected_steps = [sum(per_rollout[:gbs]), sum(per_rollout[gbs:2 * gbs])]
    assert ext[0]["samples_per_step"] == expected_steps
    assert sum(expected_steps) == sum(per_rollout)  # nothing trimmed: every sample trained
    trained = sum(c["samples"] for r in range(DP) for c in ext[r]["loss_calls"])
    assert trained == sum(per_rollout)
    for r in range(DP):
        assert ext[r]["scheduler_num_steps"] == sum(expected_steps)
        assert ext[r]["lr"] == pytest.approx([_warmup_lr(sum(expected_steps), gbs)] * len(ext[r]["lr"]))
        # micro-batches of step s saw the step's sample count as the normaliser
        calls = ext[r]["loss_calls"]
        first = ext[r]["num_microbatches"][0]
        assert {c["dynamic_global_batch_size"] for c in calls[:first]} == {expected_steps[0]}
        assert {c["dynamic_global_batch_size"] for c in calls[first:]} == {expected_steps[1]}
        # slime's own path steps by --global-batch-size samples per step, whatever the rollouts
        assert slime[r]["scheduler_num_steps"] == len(slime[r]["num_microbatches"]) * gbs
    diff = _max_diff(slime[0]["params"], ext[0]["params"])
    print(f"PARAM_DIFF v0.2.4/multi_sample: max |slime - slime-ext| after 2 steps = {diff:.3e} (they train on "
          f"different steps, by design)")
    assert diff > 1e-5


# ------------------------------------------------------------------------------------------------ slime v0.3.0+
# From v0.3.0 slime plans on the rollout side itself and its trainer consumes the schedule; slime-ext only swaps the
# planner bound in slime.ray.rollout. Both planners step by rollouts (groups) and keep groups whole, so slime's real
# train() must land on the same parameters with either.
STATIC_V03 = [(tag, case) for tag in ("v0.3.0", "v0.3.1", "HEAD") for case in ("one_sample", "multi_sample")]


@pytest.mark.parametrize("tag, case", STATIC_V03, ids=[f"{t}-{c}" for t, c in STATIC_V03])
def test_v03_slime_ext_planner_matches_slimes_planner_with_static_micro_batches(slime_git, tmp_path_factory, tag,
                                                                                  case):
    paths = _case(_tag_env(slime_git, tag), tmp_path_factory, case, tag)
    slime, ext = paths["slime"], paths["ext"]
    per_rollout = _samples(case)
    gbs = CASES[case]["gbs"]
    for r in range(DP):
        assert slime[r]["tag"] == ext[r]["tag"] == tag
        assert slime[r]["global_batch_sizes"] == ext[r]["global_batch_sizes"] == [gbs, gbs]  # rollouts per step
        assert slime[r]["scheduler_num_steps"] == ext[r]["scheduler_num_steps"] == 2 * gbs
        assert len(ext[r]["num_microbatches"]) == 2 and ext[r]["num_microbatches"] == ext[0]["num_microbatches"]
        assert {c["step_global_batch_size"] for c in slime[r]["loss_calls"]} == {gbs}
        assert {c["step_global_batch_size"] for c in ext[r]["loss_calls"]} == {gbs}
        for path in (slime[r], ext[r]):
            assert path["core_attention"] == ["ThdDotProductAttention"]
            # v0.3.0 still has --qkv-format (bshd here); from v0.3.1 every micro-batch is packed THD
            assert {c["packed"] for c in path["loss_calls"]} == {tag != "v0.3.0"}
    for path in ("slime", "ext"):
        assert sum(c["samples"] for r in range(DP) for c in paths[path][r]["loss_calls"]) == sum(per_rollout)
        assert _max_diff(paths[path][0]["params"], paths[path][1]["params"]) == 0.0
        moved = _max_diff(paths[path][0]["params"], paths[path][0]["initial_params"])
        assert moved > 1e-3
    diff = _max_diff(slime[0]["params"], ext[0]["params"])
    print(f"PARAM_DIFF {tag}/{case}: max |slime planner - slime-ext planner| after 2 steps = {diff:.3e}; "
          f"micro-batches slime {slime[0]['micro_batch_indices']} ext {ext[0]['micro_batch_indices']}")
    assert diff < PARAM_TOL


# ------------------------------------------------------------------------------------------------ dynamic, every tag
DYNAMIC = [(tag, case) for tag, cases in TAG_CASES.items() for case in cases if "max_tokens" in CASES[case]]


def _step_samples(case: str) -> list[list[int]]:
    """Global sample ids per step: one step per rollout (iteration) in the dynamic cases."""
    out, start = [], 0
    for it in iterations(CASES[case]):
        n = sum(len(r) for r in it)
        out.append(list(range(start, start + n)))
        start += n
    return out


def _lengths(case: str) -> list[int]:
    return [length for it in iterations(CASES[case]) for r in it for length in r]


@pytest.mark.parametrize("tag, case", DYNAMIC, ids=[f"{t}-{c}" for t, c in DYNAMIC])
def test_dynamic_batches_train_as_slimes_own_planner(slime_git, tmp_path_factory, tag, case):
    """slime's ``train_one_step`` with ``--use-dynamic-batch-size --max-tokens-per-gpu``, packed THD micro-batches
    through slime-ext's THD attention, planned by slime and by slime-ext from the same rollouts:

    * every sample's loss reaches slime's ``loss_function`` exactly once per step (over both DP ranks), in
      micro-batches within the token cap, every rank running the same number of micro-batches;
    * the LR scheduler advances by what slime counts (v0.2.4: samples; later: rollouts, ``global_batch_sizes``),
      and ``loss_function`` gets slime's normaliser (v0.2.4: the step's samples; later: its rollouts);
    * after the two steps both planners' parameters agree within :data:`PARAM_TOL`."""
    paths = _case(_tag_env(slime_git, tag), tmp_path_factory, case, tag)
    spec = CASES[case]
    gbs, cap = spec["gbs"], spec["max_tokens"]
    steps, lengths = _step_samples(case), _lengths(case)
    by_first = {first_token(i): i for i in range(len(lengths))}
    assert len(by_first) == len(lengths)  # the spy can tell every sample apart
    total = len(lengths)
    for name in ("slime", "ext"):
        ranks = paths[name]
        counts = ranks[0]["num_microbatches"]
        assert len(counts) == len(steps), f"{name}: {len(counts)} steps, expected {len(steps)}"
        seen_per_step = [[] for _ in steps]
        for r in range(DP):
            res = ranks[r]
            assert res["num_microbatches"] == counts, f"{name}: ranks ran different micro-batch counts"
            assert res["spec"] == ["slime_ext.training.thd_attention", "slime_layer_spec"]
            assert res["core_attention"] == ["ThdDotProductAttention"]
            calls = res["loss_calls"]
            assert len(calls) == sum(counts)
            assert all(c["packed"] for c in calls), f"{name}: a micro-batch was not packed THD"
            cursor = 0
            for s, n in enumerate(counts):
                for c in calls[cursor:cursor + n]:
                    ids = [by_first[t] for t in c["first_tokens"]]
                    assert sum(lengths[i] for i in ids) <= cap, f"{name} rank {r}: {ids} exceed the {cap}-token cap"
                    seen_per_step[s] += ids
                    if tag == "v0.2.4":  # loss normaliser: the step's samples
                        want = len(steps[s]) if name == "ext" else None  # slime's path: args.global_batch_size
                        assert c["dynamic_global_batch_size"] == want
                    else:  # the step's rollouts (slime's global_batch_sizes)
                        assert c["step_global_batch_size"] == gbs
                cursor += n
            # LR: the scheduler counted every trained sample (v0.2.4) or rollout (later) of both steps
            unit = total if tag == "v0.2.4" else 2 * gbs
            assert res["scheduler_num_steps"] == unit
            assert res["lr"] == pytest.approx([_warmup_lr(unit, gbs)] * len(res["lr"]))
            if tag != "v0.2.4":
                assert res["global_batch_sizes"] == [gbs, gbs]
        for s, ids in enumerate(seen_per_step):
            assert sorted(ids) == steps[s], f"{name} step {s}: trained {sorted(ids)}, expected {steps[s]} once each"
        assert _max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
        assert _max_diff(ranks[0]["params"], ranks[0]["initial_params"]) > 1e-3
    slime, ext = paths["slime"], paths["ext"]
    assert _max_diff(slime[0]["initial_params"], ext[0]["initial_params"]) == 0.0
    diff = _max_diff(slime[0]["params"], ext[0]["params"])
    moved = _max_diff(slime[0]["params"], slime[0]["initial_params"])
    print(f"PARAM_DIFF {tag}/{case}: max |slime - slime-ext| after 2 steps = {diff:.3e} (largest update "
          f"{moved:.2e}); micro-batches per step slime {slime[0]['num_microbatches']} ext {ext[0]['num_microbatches']}")
    assert diff < PARAM_TOL
