"""NeMo-RL's Megatron training step on CPU over gloo (:mod:`nemo_rl_fb_worker`: its real driver sharding, its
``process_global_batch``, ``get_microbatch_iterator``, ``LossPostProcessor`` with ``NLLLossFn`` and
``megatron_forward_backward``, over a tiny megatron-core GPT of 4 layers), at DP 2 and DP 2 x PP 2, from the same
canonical weights: slime-ext's plan gives NeMo-RL's own loss and gradients, within ``TOLERANCE``; with the
``variable_seq_lengths`` option under PP the micro-batches run at their own length and still give them; and the
plan at PP 2 gives what it gives at PP 1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: loss and every gradient element, absolute (fp32 training; the gradients' largest elements are ~0.2)
TOLERANCE = 1e-6
_RUNS: dict[int, list[dict]] = {}


def run(pp: int, tmp_path_factory) -> list[dict]:
    """Every rank's results (``{mode: {loss, grads, widths, packed, ...}}``) of one launch at DP 2 x PP ``pp``."""
    if pp in _RUNS:
        return _RUNS[pp]
    import torch

    from conftest import HERE, TREE
    from slime_ext.training.parallel import host_store

    world, out = 2 * pp, tmp_path_factory.mktemp(f"nemo-rl-train-pp{pp}")
    store = host_store()  # bound before any rank learns the port
    repo = os.path.dirname(os.path.dirname(HERE))
    env = {**os.environ, "NEMO_RL_TREE": TREE, "NO_VCS_VERSION": "1",
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-W", "ignore", os.path.join(HERE, "nemo_rl_fb_worker.py"), str(r),
                               str(world), str(store.port), str(pp), str(out / f"{r}.pt")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode]
    assert not failed, f"ranks {failed} failed:\n" + "\n".join(logs[r][-3000:] for r, _ in failed)
    _RUNS[pp] = [torch.load(out / f"{r}.pt") for r in range(world)]
    return _RUNS[pp]


def max_grad_diff(a: dict, b: dict) -> float:
    assert a["grads"].keys() == b["grads"].keys()
    return max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in a["grads"])


@pytest.mark.parametrize("pp", [1, 2])
def test_slime_ext_plan_gives_nemo_rls_loss_and_gradients(pp, tmp_path_factory):
    ranks = run(pp, tmp_path_factory)
    last = [r for r in ranks if r["nemo-rl"]["last_stage"]]
    assert len(last) == 2 and last[0]["nemo-rl"]["loss"] > 0
    for r in ranks:
        ours, theirs = r["slime-ext"], r["nemo-rl"]
        assert abs(ours["loss"] - theirs["loss"]) <= TOLERANCE
        assert max_grad_diff(ours, theirs) <= TOLERANCE
        assert max(float(g.abs().max()) for g in ours["grads"].values()) > 1e-3  # gradients that say something


def test_variable_seq_lengths_run_unpadded_with_the_same_loss_and_gradients(tmp_path_factory):
    """Under PP NeMo-RL pads every packed micro-batch to the longest; with the option each runs at its own length
    (megatron-core's p2p carries the shapes), and the step is the same."""
    for r in run(2, tmp_path_factory):
        varlen, theirs = r["slime-ext-varlen"], r["nemo-rl"]
        assert theirs["widths"] == [max(theirs["packed"])] * len(theirs["widths"])  # NeMo-RL's pad to the longest
        assert varlen["widths"] == varlen["packed"] and len(set(varlen["widths"])) > 1
        assert abs(varlen["loss"] - theirs["loss"]) <= TOLERANCE
        assert max_grad_diff(varlen, theirs) <= TOLERANCE


def test_the_plan_at_pp_2_trains_what_it_trains_at_pp_1(tmp_path_factory):
    """The same canonical weights at PP 1 and PP 2: the last stage's loss and each parameter's gradient (by its
    canonical name, wherever it lives) agree, with and without the pad (what dynamic batching becomes under PP)."""
    one, two = run(1, tmp_path_factory), run(2, tmp_path_factory)
    reference = one[0]["slime-ext"]
    for r in two:
        for mode in ("slime-ext", "slime-ext-varlen"):
            result = r[mode]
            if result["last_stage"]:
                assert abs(result["loss"] - reference["loss"]) <= TOLERANCE
            for name, grad in result["grads"].items():
                assert float((grad - reference["grads"][name]).abs().max()) <= TOLERANCE, name


@pytest.mark.parametrize("pp", [1, 2])
def test_log_prob_pass_returns_nemo_rls_log_probs_in_its_order(pp, tmp_path_factory):
    """NeMo-RL's forward-only worker pass (its iterator, ``LogprobsPostProcessor``, ``megatron_forward_backward``)
    over slime-ext's log-prob shards, gathered and put back in order by NeMo-RL's ``reorder_data``: the log-probs of
    NeMo-RL's own path, row by row (slime-ext's plan moved rows between ranks, so the order had to be restored)."""
    for r in run(pp, tmp_path_factory):
        theirs = r["nemo-rl"]["logprobs"]
        if theirs is None:  # not the last stage
            continue
        assert float(theirs.abs().max()) > 0.1
        for mode in [m for m in r if m != "nemo-rl"]:
            assert r[mode]["rows_moved"]
            assert float((r[mode]["logprobs"] - theirs).abs().max()) <= TOLERANCE, mode
