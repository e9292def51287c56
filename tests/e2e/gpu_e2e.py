"""The end-to-end check of ``ci/gpu_e2e``: rollout -> schedule -> training on the device, without Ray or pytest.

A plain script, not a pytest module: the offline GPU machine has neither pytest nor Ray. Run it from the
repository root with the repository on ``PYTHONPATH`` (``ci/gpu_e2e`` and ``ci/gpu_all`` do).

    python tests/e2e/gpu_e2e.py             # on a GPU: NCCL, one train process per GPU (DP = the GPU count)
    python tests/e2e/gpu_e2e.py --dry-run   # anywhere: CPU, gloo, DP=2, a tiny model, seconds

Each run is the harness with ``launcher: processes`` (:mod:`slime_ext.rollout.processes`): the synthetic rollout
function generates in the driver process, slime-ext plans every DP rank's micro-batches, and the train ranks are
``torch.multiprocessing`` processes running megatron-core's schedule. Three runs over the same rollouts:

1. **fp32, token cap A** and 2. **fp32, token cap B**: different micro-batches, the same steps. The parameters after
   training must agree within ``--rtol`` (relative to each tensor's largest entry; default 1e-5) -- the schedule
   must not change what is learnt -- and the update must move them.
3. **bf16** (GPU; ``torch.autocast`` around every train step; the dry run stays fp32, as CPU runs do): same steps
   again. Its update must follow the fp32 update (relative distance of the two updates under ``--bf16-tol``).

Every run also checks: each rollout's ledger (every kept sample trained exactly once, where planned: the harness's
``verify_ledger``), every loss finite, the LR scheduler's sample counter equal to the samples trained, every rank's
backend and device (NCCL on CUDA, or gloo on CPU in the dry run), and that Ray was never imported. Exit 0 when
everything holds, 1 with the failed checks listed, 2 when the machine cannot run it (no CUDA and no ``--dry-run``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from bench.verdict import verdict

#: the GPU run's model (small: this checks correctness; bench/gpu_replay measures a ~1B model)
GPU_MODEL = dict(num_layers=4, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048, vocab_size=4096,
                 seq_length=1024, max_position_embeddings=1024)
TINY_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128,
                  seq_length=128, max_position_embeddings=128)
#: SGD without momentum: the update is -lr * grad, so comparing parameters compares gradients
OPTIM = dict(optimizer="sgd", sgd_momentum=0.0, lr=0.5, weight_decay=0.0, clip_grad=1.0, seed=1234,
             lr_decay_style="constant")


def run_config(model: dict, dp: int, device: str, cap: int, autocast: str | None, num_rollout: int) -> dict:
    """One harness config: dynamic micro-batches under ``cap``, balanced, rollouts of several sizes per step."""
    seq = model["seq_length"]
    return {
        **model, **OPTIM,
        "launcher": "processes", "device": device, "train_autocast": autocast,
        "actor_num_nodes": 1, "actor_num_gpus_per_node": dp, "data_parallel_size": dp,
        "dp_schedule": "rollout", "global_batch_size": 4 * dp, "use_dynamic_batch_size": True,
        "max_tokens_per_gpu": cap, "balance_data": True,
        "num_rollout": num_rollout, "rollout_batch_size": 6 * dp, "n_samples_per_prompt": 2, "rollout_seed": 5,
        "synthetic_prompt_length_max": max(8, seq // 8), "synthetic_response_length_median": max(8, seq // 6),
        "verify_ledger": True,
    }


def train(config_map: dict, say) -> dict:
    """Run the harness on ``config_map``; the rows, layouts, rank-0 parameters and every rank's scheduler state."""
    from slime_ext.rollout.config import load_run_config
    from slime_ext.rollout.processes import run

    config = load_run_config(config_map)
    got: dict = {}

    world = config.world_size

    def initial(group) -> None:
        got["initial"] = group.call("param_snapshot", [()] * world, 300.0, "param_snapshot")[0]

    def final(group) -> None:
        got["params"] = group.call("param_snapshot", [()] * world, 300.0, "param_snapshot")
        got["scheduler"] = group.call("scheduler_state", [()] * world, 60.0, "scheduler_state")

    start = time.perf_counter()
    result = run(config, out=say, on_ready=initial, on_done=final)
    say(f"  ({time.perf_counter() - start:.1f} s)")
    trained = sum(row["samples"] for row in result.rows)
    return {"rows": result.rows, "layouts": result.layouts, "params": got["params"], "initial": got["initial"],
            "scheduler": got["scheduler"], "trained": trained}


def param_rel_diff(a: dict, b: dict) -> float:
    """Largest ``|a - b|`` of a tensor relative to that tensor's largest entry in ``b``."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-12)) for k in b)


def update_rel_diff(a: dict, b: dict, initial: dict) -> float:
    """``||(a - p0) - (b - p0)|| / ||b - p0||`` over all parameters (``b``'s update as the reference)."""
    num = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in b)
    den = sum(float(np.sum((b[k].astype(np.float64) - initial[k]) ** 2)) for k in b)
    return math.sqrt(num / den) if den else float("inf")


def _norm_ratio(params: dict, initial: dict) -> float:
    """``||params - initial|| / ||initial||`` over all parameters."""
    num = sum(float(np.sum((params[k].astype(np.float64) - initial[k]) ** 2)) for k in initial)
    den = sum(float(np.sum(initial[k].astype(np.float64) ** 2)) for k in initial)
    return math.sqrt(num / den)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/e2e/gpu_e2e.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, fp32, a tiny model (checks the code path)")
    p.add_argument("--dp", type=int, default=None, help="train processes (default: the GPU count; dry run 2)")
    p.add_argument("--rtol", type=float, default=1e-5, help="fp32 cap A vs cap B, relative per tensor")
    p.add_argument("--bf16-tol", type=float, default=0.1,
                   help="bf16 update vs fp32 update, relative distance (GPU only; CPU bf16 autocast on the dry-run "
                        "model measured 0.021)")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the dry run stays on CPU even on a GPU host

    import torch

    gpu = torch.cuda.is_available() and not args.dry_run
    if not gpu and not args.dry_run:
        print("tests/e2e/gpu_e2e.py: no CUDA device; run it on a GPU (ci/gpu_e2e) or pass --dry-run", file=sys.stderr)
        return 2
    device = "cuda" if gpu else "cpu"
    dp = args.dp or (torch.cuda.device_count() if gpu else 2)
    model = GPU_MODEL if gpu else TINY_MODEL
    seq = model["seq_length"]
    caps = (seq, 3 * seq)
    failures: list[str] = []
    checked: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)

    def check(ok: bool, what: str) -> None:
        say(f"  {'ok  ' if ok else 'FAIL'} {what}")
        checked.append(what)
        if not ok:
            failures.append(what)

    what_device = torch.cuda.get_device_name() if gpu else "cpu (dry run)"
    say(f"# slime-ext e2e without Ray on {what_device}: DP={dp}, model {model}, {OPTIM['optimizer']} lr "
        f"{OPTIM['lr']}")
    runs = {}
    plan = [("fp32 cap A", caps[0], None), ("fp32 cap B", caps[1], None)]
    if gpu:
        plan.append(("bf16", caps[0], "bfloat16"))
    initial = None
    for name, cap, autocast in plan:
        say(f"\n## {name}: max_tokens_per_gpu {cap}, {'bf16 autocast' if autocast else 'fp32'}")
        res = train(run_config(model, dp, device, cap, autocast, num_rollout=2), say)
        runs[name] = res
        want_backend = "nccl" if gpu else "gloo"
        check(all(lay["backend"] == want_backend and lay["device"] == device for lay in res["layouts"]),
              f"{name}: every rank ran {want_backend} on {device} "
              f"({sorted({(lay['backend'], lay['device']) for lay in res['layouts']})})")
        import slime_ext

        check({lay["slime_ext"] for lay in res["layouts"]} == {slime_ext.__file__},
              f"{name}: every rank imported slime-ext from {os.path.dirname(slime_ext.__file__)}")
        check(all(math.isfinite(row["loss"]) for row in res["rows"]), f"{name}: every step's loss is finite")
        check({s["samples"] for s in res["scheduler"]} == {res["trained"]},
              f"{name}: the LR scheduler counted {sorted({s['samples'] for s in res['scheduler']})} samples, "
              f"the steps trained {res['trained']}")
        check(all(np.array_equal(res["params"][0][k], r[k]) for r in res["params"][1:] for k in r),
              f"{name}: the DP replicas hold identical parameters")
        if initial is None:
            initial = res["initial"]
        else:
            check(param_rel_diff(res["initial"], initial) == 0.0, f"{name}: started from the same parameters")
    a, b = runs["fp32 cap A"], runs["fp32 cap B"]
    say("\n## checks across runs")
    check([row["samples"] for row in a["rows"]] == [row["samples"] for row in b["rows"]],
          "cap A and cap B trained the same steps")
    check([row["mbs_per_rank"] for row in a["rows"]] != [row["mbs_per_rank"] for row in b["rows"]],
          "cap A and cap B cut different micro-batches (else the comparison proves nothing)")
    diff = param_rel_diff(a["params"][0], b["params"][0])
    moved = _norm_ratio(a["params"][0], initial)
    check(diff <= args.rtol, f"fp32 parameters after training, cap A vs cap B: max relative difference "
                             f"{diff:.2e} (tolerance {args.rtol:.0e})")
    check(moved > 1e-3, f"training moved the parameters (||update|| / ||initial|| = {moved:.2e})")
    if gpu:
        dist = update_rel_diff(runs["bf16"]["params"][0], a["params"][0], initial)
        check(dist <= args.bf16_tol, f"bf16 update vs fp32 update: relative distance {dist:.3f} "
                                     f"(tolerance {args.bf16_tol})")
    check("ray" not in sys.modules, "Ray was never imported")
    say(f"\n{verdict(not failures, len(checked), 'no check ran')}: {len(failures)} failed check(s)" +
        "".join(f"\n  - {f}" for f in failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
