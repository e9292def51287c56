"""The worker's result file, and the readers and comparisons the host tests use.

File format (``torch.save`` of a dict; load with ``torch.load(path, weights_only=False)`` or :func:`load`)::

    {"format": "slime-ext/megatron-rl-worker/1",
     "megatron_version": "0.20.0",                 # megatron.core.package_info of the tree that ran
     "megatron_lm_tree": {"path", "commit"},       # the tree (commit: written by ci/megatron_rl_test)
     "ranks": [rank_record, ...]}                  # index = global rank

    rank_record = {
      "rank", "dp_rank", "pp_rank", "dp_size", "pp_size", "vpp_size",   # where this rank sits
      "iteration": int,                            # what train() returned
      "megatron_version": str, "megatron_lm_tree": {"path", "commit"},   # commit: from ci/megatron_rl_test
      "args": {global_batch_size, micro_batch_size, seq_length, grpo_prompts_per_step, grpo_group_size, ...},
      "schedule": {max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, num_steps},
      "samples": {sid: {collection, index, group, length, prompt_length}},   # every sample of every collection
      "initial_params": {canonical name: flat fp32 tensor},   # after the canonical initialisation, before train()
      "steps": [                                   # one per optimizer step, in order
        {"iteration", "collection",                # train()'s iteration; the collection it trained on
         "num_microbatches": int,                  # get_num_microbatches() when train_step ran
         "micro_batches": [{"samples": [sid, ...], # what this rank's first model chunk received, in order
                            "tokens": int,         # computed tokens (the row length, padding included)
                            "real_tokens": int,    # tokens of the samples in it
                            "segments": [(start, length)], "unknown": [...]}],   # unknown: unrecognised rows
         "lr", "lrs", "num_steps",                 # after the step: param_groups[0]["lr"], scheduler.num_steps
         "consumed_train_samples": int,            # args.consumed_train_samples after the step
         "lr_schedule_at_num_steps",               # Megatron's schedule (get_lr) at num_steps ...
         "lr_schedule_at_consumed_samples",        # ... and at consumed_train_samples
         "skipped", "grad_norm", "loss": {name: [values]},
         "params": {canonical name: flat fp32 tensor}}],   # this rank's parameters after the step
      "logprobs": {collection: {"old": {sid: tensor}, "ref": {sid: tensor}}},  # len L-1 per sample, this rank's bins
      "logprob_micro_batches": {collection: [micro_batch, ...]},   # both log-prob passes, in order
      "train_counts": {collection: {sid: times trained on this rank}},
      "timing": {"setup_s", "train_s"}}

Sample ids (sid) are ``collection * samples_per_collection + index`` (index: group-major position).

Comparing two runs (e.g. ``--path megatron`` and ``--path ext``) goes through :func:`params_after`,
:func:`sample_logprobs`, :func:`max_param_diff`, :func:`max_logprob_diff` and :func:`lr_vs_schedule`.
"""

from __future__ import annotations

import torch

FORMAT = "slime-ext/megatron-rl-worker/1"


def save(path: str, ranks: list[dict]) -> None:
    versions = {r["megatron_version"] for r in ranks}
    if len(versions) != 1:
        raise ValueError(f"ranks report different megatron versions: {sorted(versions)}")
    torch.save({"format": FORMAT, "megatron_version": versions.pop(), "megatron_lm_tree": ranks[0]["megatron_lm_tree"],
                "ranks": ranks}, path)


def load(path: str) -> dict:
    result = torch.load(path, weights_only=False)
    if result.get("format") != FORMAT:
        raise ValueError(f"{path}: format {result.get('format')!r}, expected {FORMAT!r}")
    return result


# ---------------------------------------------------------------------------------------------------- readers
def params_after(result: dict, step: int | None) -> dict[str, torch.Tensor]:
    """The whole model after optimizer step ``step`` (0-based; ``None``: before the first), by canonical name, from
    every rank.

    Every copy of a parameter (DP replicas, the tied embedding on the first and last stage) must be equal; a
    difference raises, since it means the replicas diverged."""
    merged: dict[str, torch.Tensor] = {}
    for r in result["ranks"]:
        params = r["initial_params"] if step is None else r["steps"][step]["params"]
        for name, value in params.items():
            if name in merged and not torch.equal(merged[name], value):
                diff = (merged[name] - value).abs().max().item()
                raise AssertionError(f"step {step}: copies of {name} differ by {diff:.3e} (rank {r['rank']})")
            merged.setdefault(name, value)
    return merged


def sample_logprobs(result: dict, kind: str) -> dict[int, torch.Tensor]:
    """``kind`` ("old" or "ref") log-probs per sample id over every collection, from every rank; the copies held by
    several ranks (pipeline stages) must be equal."""
    merged: dict[int, torch.Tensor] = {}
    for r in result["ranks"]:
        for per_kind in r["logprobs"].values():
            for sid, vec in per_kind[kind].items():
                if sid in merged and not torch.equal(merged[sid], vec):
                    raise AssertionError(f"{kind} log-probs of sample {sid} differ between ranks")
                merged.setdefault(sid, vec)
    return merged


def train_counts(result: dict) -> dict[int, dict[int, int]]:
    """Times each sample was trained per collection, summed over DP ranks (first pipeline stage only, as every
    stage of one pipeline sees the same micro-batches)."""
    total: dict[int, dict[int, int]] = {}
    for r in result["ranks"]:
        if r["pp_rank"] != 0:
            continue
        for collection, counts in r["train_counts"].items():
            into = total.setdefault(collection, {})
            for sid, n in counts.items():
                into[sid] = into.get(sid, 0) + n
    return total


# ---------------------------------------------------------------------------------------------------- comparisons
# The --path ext comparisons (issue 28: "parameters after the step and log-probs equal to Megatron-RL's own path
# within 1e-6", "the LR after N steps equals the schedule evaluated at the samples trained") go through these.
def max_param_diff(a: dict, b: dict, step: int) -> float:
    """Largest absolute difference between the models of two runs after ``step``; the runs must name the same
    parameters with the same shapes."""
    pa, pb = params_after(a, step), params_after(b, step)
    if set(pa) != set(pb):
        raise AssertionError(f"parameter names differ: {sorted(set(pa) ^ set(pb))}")
    diffs = []
    for name in pa:
        if pa[name].shape != pb[name].shape:
            raise AssertionError(f"{name}: shape {tuple(pa[name].shape)} vs {tuple(pb[name].shape)}")
        diffs.append((pa[name] - pb[name]).abs().max().item())
    return max(diffs)


def max_logprob_diff(a: dict, b: dict, kind: str) -> float:
    """Largest absolute difference between two runs' per-sample ``kind`` log-probs; both must cover the same
    samples with vectors of the same length."""
    la, lb = sample_logprobs(a, kind), sample_logprobs(b, kind)
    if set(la) != set(lb):
        raise AssertionError(f"{kind} log-probs cover different samples: {sorted(set(la) ^ set(lb))[:10]} ...")
    return max((la[s] - lb[s]).abs().max().item() for s in la)


def lr_vs_schedule(result: dict) -> list[dict]:
    """Per step (rank 0): the LR the optimizer holds, the schedule at ``num_steps`` (what Megatron's scheduler
    counted) and at ``consumed_train_samples`` (the samples really trained)."""
    return [dict(step=i, lr=s["lr"], num_steps=s["num_steps"], consumed=s["consumed_train_samples"],
                 at_num_steps=s["lr_schedule_at_num_steps"], at_consumed=s["lr_schedule_at_consumed_samples"])
            for i, s in enumerate(result["ranks"][0]["steps"])]


# ---------------------------------------------------------------------------------------------------- a summary
def describe(result: dict) -> str:
    """Per step and rank: micro-batches, samples, real / computed tokens, LR, the scheduler's count, consumed."""
    r0 = result["ranks"][0]
    lines = [f"Megatron-LM {result['megatron_version']} ({result.get('megatron_lm_tree', {}).get('commit')}), "
             f"dp {r0['dp_size']} pp {r0['pp_size']} vpp {r0['vpp_size']}, global batch {r0['args']['global_batch_size']}"
             f", {len(r0['samples'])} samples in {len({s['collection'] for s in r0['samples'].values()})} collection(s)"]
    for i, step in enumerate(r0["steps"]):
        per_rank = []
        for r in result["ranks"]:
            if r["pp_rank"]:
                continue
            mbs = r["steps"][i]["micro_batches"]
            real, computed = sum(m["real_tokens"] for m in mbs), sum(m["tokens"] for m in mbs)
            per_rank.append(f"dp{r['dp_rank']}: {len(mbs)} mb, {sum(len(m['samples']) for m in mbs)} samples, "
                            f"{real}/{computed} tokens")
        lines.append(f"step {i}: " + "; ".join(per_rank) + f" | lr {step['lr']:.6g} (schedule at num_steps "
                     f"{step['num_steps']}: {step['lr_schedule_at_num_steps']:.6g}, at consumed "
                     f"{step['consumed_train_samples']}: {step['lr_schedule_at_consumed_samples']:.6g})")
    twice = {c: sorted(s for s, n in counts.items() if n > 1) for c, counts in train_counts(result).items()}
    lines.append(f"samples trained more than once per collection: {twice}")
    lines.append("timing: " + ", ".join(f"rank {r['rank']} setup {r['timing']['setup_s']:.1f} s train "
                                         f"{r['timing']['train_s']:.1f} s" for r in result["ranks"]))
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    for path in sys.argv[1:]:
        print(f"== {path}\n{describe(load(path))}")
