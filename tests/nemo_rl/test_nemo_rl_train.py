"""NeMo-RL's Megatron training step on CPU over gloo (:mod:`nemo_rl_fb_worker`: its real driver sharding, its
``process_global_batch``, ``get_microbatch_iterator``, ``LossPostProcessor`` with ``NLLLossFn`` and
``megatron_forward_backward``, over a tiny megatron-core GPT of 4 layers), at DP 2 and DP 2 x PP 2, from the same
canonical weights: slime-ext's plan gives NeMo-RL's own loss and gradients, within ``TOLERANCE``: by default, under
PP with the micro-batches at their own length, and with the ``pad_to_longest`` opt-out padded as NeMo-RL pads them;
and the plan at PP 2 gives what it gives at PP 1. Each comparison prints its largest differences (``-s``)."""

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


def report(what: str, ranks: list[dict], mode: str, against: str = "nemo-rl") -> None:
    loss = max(abs(r[mode]["loss"] - r[against]["loss"]) for r in ranks)
    grads = max(max_grad_diff(r[mode], r[against]) for r in ranks)
    print(f"{what}: {mode} against {against}: loss {loss:.2g}, gradients {grads:.2g} (largest differences)")


@pytest.mark.parametrize("pp,mode", [(1, "slime-ext"), (2, "slime-ext"), (2, "slime-ext-pad")])
def test_slime_ext_plan_gives_nemo_rls_loss_and_gradients(pp, mode, tmp_path_factory):
    """At PP 2 the default runs each packed micro-batch at its own length (NeMo-RL's own path pads them to the
    longest, megatron-core's p2p then carrying one shape), the opt-out pads them as NeMo-RL does (at PP 1 the
    opt-out changes nothing)."""
    ranks = run(pp, tmp_path_factory)
    last = [r for r in ranks if r["nemo-rl"]["last_stage"]]
    assert len(last) == 2 and last[0]["nemo-rl"]["loss"] > 0
    report(f"DP 2 x PP {pp}", ranks, mode)
    for r in ranks:
        ours, theirs = r[mode], r["nemo-rl"]
        assert abs(ours["loss"] - theirs["loss"]) <= TOLERANCE
        assert max_grad_diff(ours, theirs) <= TOLERANCE
        assert max(float(g.abs().max()) for g in ours["grads"].values()) > 1e-3  # gradients that say something
        if pp > 1:
            assert theirs["widths"] == [max(theirs["packed"])] * len(theirs["widths"])  # NeMo-RL's pad
            if mode == "slime-ext":  # each at its own length, and they differ
                assert ours["widths"] == ours["packed"] and len(set(ours["widths"])) > 1
            else:
                assert ours["widths"] == [max(ours["packed"])] * len(ours["widths"])


def test_the_plan_at_pp_2_trains_what_it_trains_at_pp_1(tmp_path_factory):
    """The same canonical weights at PP 1 and PP 2: the last stage's loss and each parameter's gradient (by its
    canonical name, wherever it lives) agree, with and without the pad (what dynamic batching becomes under PP)."""
    one, two = run(1, tmp_path_factory), run(2, tmp_path_factory)
    for mode in ("slime-ext", "slime-ext-pad"):
        loss = max(abs(r[mode]["loss"] - one[0]["slime-ext"]["loss"]) for r in two if r[mode]["last_stage"])
        grads = max(float((g - one[0]["slime-ext"]["grads"][n]).abs().max()) for r in two
                    for n, g in r[mode]["grads"].items())
        print(f"PP 2 ({mode}) against PP 1 (slime-ext): loss {loss:.2g}, gradients {grads:.2g}")
    reference = one[0]["slime-ext"]
    for r in two:
        for mode in ("slime-ext", "slime-ext-pad"):
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
        assert r["slime-ext"]["rows_moved"]
        for mode in [m for m in r if m != "nemo-rl"]:
            assert r[mode]["rows_moved"] or r[mode]["nemo_rls_own_ran"]  # the opt-out may run NeMo-RL's own
            difference = float((r[mode]["logprobs"] - theirs).abs().max())
            print(f"log-probs at DP 2 x PP {pp}, {mode} against nemo-rl: largest difference {difference:.2g}")
            assert difference <= TOLERANCE, mode
