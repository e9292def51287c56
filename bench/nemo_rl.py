"""NeMo-RL's own sharding next to slime-ext's plan, on the same rollouts.

    NEMO_RL_TREE=/path/to/RL .venv-nemo-rl/bin/python -m bench.nemo_rl [--quick] [--strict]

``NEMO_RL_TREE`` (or ``--nemo-rl``) is a NeMo-RL checkout or extracted tree (``git archive``; ``ci/nemo_rl_test``
leaves one in ``.nemo-rl-trees/HEAD``). It is put first on ``sys.path`` and NeMo-RL's code runs from it (nothing of
it is copied here); it needs Python >= 3.13 and torch (the venv ``ci/nemo_rl_test`` builds). ``--quick``: one
workload at dp 8; ``--strict``: exit 1 when a goal is missed.

**NeMo-RL's plans**, from its own ``BatchedDataDict.shard_by_batch_size`` at run time, as ``Policy._shard_for_train``
(``batch_size`` = the global batch, ``train_mb_tokens``) and ``_shard_for_logprob`` (one pass, ``logprob_mb_tokens``)
call it: sequence packing with its default packer (MFFD) and with FFD, and dynamic batching where NeMo-RL allows it
(one pipeline stage). **slime-ext's plan**: :func:`slime_ext.integrations.nemo_rl.plan.plan_shards`, what the
integration runs in the same two calls, forward-only for the log-prob pass.

**How a plan runs** (what NeMo-RL's Megatron worker does with the shard metadata): a packed micro-batch computes
its rows, each rounded up to ``make_sequence_length_divisible_by``; with pipeline parallelism every packed
micro-batch is padded to the longest of its rank's global batch (``_get_pack_sequence_parameters_for_megatron``),
for NeMo-RL's plans. Column ``ours``: what the switch runs by default, slime-ext's plan, whose worker class runs
each packed micro-batch at its own length under pipeline parallelism (megatron-core's variable sequence lengths),
planned without the pad. Column ``ours+pad``: the ``pad_to_longest`` opt-out (NeMo-RL's worker and its pad):
slime-ext's plan made with the pad priced in or, where the switch predicts it faster, NeMo-RL's own sharding of the
same call (:func:`slime_ext.integrations.nemo_rl.plan.choose_padded`), the user's packer being the one of NeMo-RL's
best setting in that case (column ``won``: the passes where NeMo-RL's own ran); at one stage it is ``ours``. A
dynamic micro-batch computes ``rows x its longest row`` (rounded to ``sequence_length_round``).

**Pricing**: slime-ext's pipeline model (:func:`slime_ext.schedule.pipeline_pricing`; forward-only for the log-prob
pass): forward FLOPs of Qwen3-8B-like dims (:mod:`bench.workloads`), a pad token at the per-token rate as the
integration prices it (:func:`slime_ext.integrations.nemo_rl.plan.padded_micro_batch_costs`), each micro-batch
charged the pricing's overhead, backward 2x forward, 1F1B at pp 4; pp 1 is the same pricing with one stage.

**Columns**: ``train``: the predicted training pass, the global batches' slowest-replica makespans summed, TFLOP of one
GPU's work; ``logprob``: one forward-only pass, the slowest rank's; ``comp/real``: computed tokens over real tokens in
the training pass; ``mb/rank``: micro-batches per DP rank per global batch; ``bad``: invalid plans (unequal counts
across ranks, a micro-batch of several rows over the cap, a row lost or repeated). ``ours/best``: our training pass
over NeMo-RL's best valid setting; ``plan s``: seconds slime-ext took to plan the training pass (the default).
These are predictions of a model, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from slime_ext.integrations.nemo_rl.plan import choose_padded, padded_micro_batch_costs, plan_shards, round_up
from slime_ext.schedule import CostModel, ParallelConfig, PipelineSpec, pipeline_pricing

from .runner import parser
from .workloads import MODEL_DIMS, make_lengths

MAX_LENGTH = 16384
TRAIN_MB_TOKENS = 16384
LOGPROB_MB_TOKENS = 32768
PAD = 8  # make_sequence_length_divisible_by
ROUND = 64  # dynamic_batching.sequence_length_round
GROUP_SIZE = 16
PROMPTS_PER_DP_RANK = 4
GLOBAL_BATCHES = 2
DP_SIZES = (8, 32)
PP_SIZES = (1, 4)
WORKLOADS = {"rl-like": "rl", "bimodal": "bimodal", "long tail": "heavy"}
SETTINGS = ("mffd", "ffd", "dynamic")
PACKERS = {"mffd": "modified_first_fit_decreasing", "ffd": "first_fit_decreasing"}
SEED = 1
#: goals: our training pass at most this share of NeMo-RL's best setting (geomean)
GOALS = {1: 0.97, 4: 0.90}
TFLOP = 1e12
HOW = ("set NEMO_RL_TREE (or pass --nemo-rl) to a NeMo-RL checkout or tree, e.g. the one ci/nemo_rl_test extracts "
       "into .nemo-rl-trees/HEAD, and run with its venv (.venv-nemo-rl/bin/python: Python 3.13, torch)")


@dataclass(frozen=True)
class Pass:
    """One shard call as the workers run it: ``mbs[g][r]``, rank ``r``'s micro-batches of global batch ``g``, each
    ``(rows, computed tokens, forward FLOPs)``; ``invalid``: why the plan is invalid, or ``""``."""

    mbs: tuple
    invalid: str


@dataclass(frozen=True)
class Figures:
    train: float
    logprob: float
    computed: int
    real: int
    counts: tuple[int, ...]
    invalid: str


# ----------------------------------------------------------------------------------------------------- pricing
def pricing(dp: int, pp: int, cost_model: CostModel, cap: int, forward_only: bool):
    """slime-ext's pricing of a ``dp x pp`` layout; pp 1: the same pricing with one stage."""
    if pp > 1:
        return pipeline_pricing(ParallelConfig(dp_size=dp, pp_size=pp), cost_model, cap, forward_only=forward_only)
    two = pipeline_pricing(ParallelConfig(dp_size=dp, pp_size=2), cost_model, cap, forward_only=forward_only)
    return dataclasses.replace(two, spec=PipelineSpec(pp_size=1), scale=1.0, stage_share=None)


def packed_mb(rows: Sequence[int], lengths: np.ndarray, width: int, cost_model: CostModel) -> tuple:
    """A packed micro-batch of ``rows`` (each rounded up to ``PAD``) padded to ``width`` tokens (its own length when
    ``width`` is smaller), priced as the integration prices the pad."""
    packed = np.array([round_up(lengths[i], PAD) for i in rows], dtype=np.int64)
    tokens = max(int(packed.sum()), width)
    flops = padded_micro_batch_costs([list(range(len(rows)))], packed, cost_model, width=width)[0]
    return tuple(rows), tokens, float(flops)


def dynamic_mb(rows: Sequence[int], seqlen: int, cost_model: CostModel) -> tuple:
    return tuple(rows), len(rows) * seqlen, float(cost_model.flops([seqlen])[0]) * len(rows)


def judge(train: Pass, logprob: Pass, lengths: np.ndarray, dp: int, pp: int, cost_model: CostModel) -> Figures:
    prices = {False: pricing(dp, pp, cost_model, TRAIN_MB_TOKENS, False),
              True: pricing(dp, pp, cost_model, LOGPROB_MB_TOKENS, True)}

    def time_of(run: Pass, forward_only: bool) -> float:
        total = 0.0
        for gb in run.mbs:
            if len({len(rank) for rank in gb}) != 1:  # priced rank by rank (an invalid plan deadlocks anyway)
                total += max(float(prices[forward_only].makespans(np.array([[mb[2] for mb in rank]])).max())
                             for rank in gb)
                continue
            total += float(prices[forward_only].makespans(np.array([[mb[2] for mb in rank] for rank in gb])).max())
        return total

    computed = sum(mb[1] for gb in train.mbs for rank in gb for mb in rank)
    counts = tuple(len(gb[0]) for gb in train.mbs)
    return Figures(time_of(train, False), time_of(logprob, True), computed, int(lengths.sum()), counts,
                   train.invalid or logprob.invalid)


def check(mbs: tuple, n: int, cap: int, dynamic: bool) -> str:
    """Why a pass is invalid, or ``""``."""
    seen = sorted(i for gb in mbs for rank in gb for mb in rank for i in mb[0])
    if seen != list(range(n)):
        return "rows lost or repeated"
    if any(len({len(rank) for rank in gb}) != 1 for gb in mbs):
        return "unequal counts"
    over = [mb for gb in mbs for rank in gb for mb in rank if len(mb[0]) > 1 and mb[1] > cap]
    return f"{len(over)} over cap" if over and not dynamic else ("over cap" if over else "")


# ------------------------------------------------------------------------------------------------ the two plans
def nemo_rl_pass(nemo: Any, lengths: np.ndarray, dp: int, pp: int, setting: str, forward_only: bool,
                 cost_model: CostModel) -> Pass:
    """NeMo-RL's own ``shard_by_batch_size`` on the rollouts, as its Policy calls it."""
    import torch

    n = len(lengths)
    cap = LOGPROB_MB_TOKENS if forward_only else TRAIN_MB_TOKENS
    batch_size = None if forward_only else n // GLOBAL_BATCHES
    width = int(lengths.max()) if setting == "dynamic" else 1
    data = nemo.BatchedDataDict({"input_ids": torch.zeros((n, width), dtype=torch.uint8),
                                 "input_lengths": torch.tensor(lengths), "row": torch.arange(n)})
    common = {"max_tokens_per_microbatch": cap, "input_key": "input_ids", "input_lengths_key": "input_lengths"}
    if setting == "dynamic":
        shards, _ = data.shard_by_batch_size(dp, batch_size=batch_size, dynamic_batching_args={
            **common, "sequence_length_round": ROUND})
    else:
        shards, _ = data.shard_by_batch_size(dp, batch_size=batch_size, sequence_packing_args={
            **common, "algorithm": PACKERS[setting], "sequence_length_pad_multiple": PAD})
    num_gb = 1 if batch_size is None else GLOBAL_BATCHES
    mbs = []
    for g in range(num_gb):
        gb = []
        for shard in shards:
            if setting == "dynamic":
                local = shard.slice(g * (n // num_gb // dp), (g + 1) * (n // num_gb // dp))
            else:
                local = shard.get_batch(batch_idx=g)
            rows = local["row"].tolist()
            bounds, seqlens = shard.micro_batch_indices[g], shard.micro_batch_lengths[g]
            width_pp = max(seqlens) if pp > 1 else 0
            gb.append(tuple(dynamic_mb(rows[s:e], L, cost_model) if setting == "dynamic"
                            else packed_mb(rows[s:e], lengths, width_pp, cost_model)
                            for (s, e), L in zip(bounds, seqlens)))
        mbs.append(tuple(gb))
    return Pass(tuple(mbs), check(tuple(mbs), n, cap, setting == "dynamic"))


def ours_pass(lengths: np.ndarray, dp: int, pp: int, forward_only: bool, cost_model: CostModel,
              pad_to_longest: bool, theirs: Pass | None = None) -> tuple[Pass, float, bool]:
    """What the switch runs, its planning seconds, and whether NeMo-RL's own plan ran: slime-ext's plan;
    ``pad_to_longest``: as NeMo-RL's worker runs it under pipeline parallelism, where ``theirs`` (NeMo-RL's own
    pass of the same call) runs instead when :func:`choose_padded` predicts it faster, as the integration does."""
    n = len(lengths)
    cap = LOGPROB_MB_TOKENS if forward_only else TRAIN_MB_TOKENS
    t = time.perf_counter()
    parallel = ParallelConfig(dp_size=dp, pp_size=pp)
    plan = plan_shards(lengths, parallel=parallel, batch_size=None if forward_only else n // GLOBAL_BATCHES, cap=cap,
                       pad_multiple=PAD, forward_only=forward_only, cost_model=cost_model,
                       pad_to_longest=pad_to_longest)
    seconds = time.perf_counter() - t
    padded = pad_to_longest and pp > 1
    if padded and theirs is not None:
        rows = [[[list(mb[0]) for mb in rank] for rank in gb] for gb in theirs.mbs]
        if choose_padded(plan.padded_time, rows, plan.padded_lengths, parallel=parallel, cap=plan.cap,
                         forward_only=forward_only, cost_model=cost_model).theirs_wins:
            return theirs, seconds, True
    mbs = []
    for g in range(plan.num_global_batches):
        gb = []
        for r in range(dp):
            start = sum(plan.elem_counts_per_gb[r][:g])
            rows = plan.rows[r][start:start + plan.elem_counts_per_gb[r][g]]
            width = max(plan.micro_batch_lengths[r][g]) if padded else 0
            gb.append(tuple(packed_mb(rows[s:e], lengths, width, cost_model)
                            for s, e in plan.micro_batch_indices[r][g]))
        mbs.append(tuple(gb))
    return Pass(tuple(mbs), check(tuple(mbs), n, cap, False)), seconds, False


# ------------------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    workload: str
    dp: int
    pp: int
    theirs: dict  # setting -> Figures
    ours: Figures  # the default: micro-batches at their own length under PP
    padded: Figures  # the pad_to_longest opt-out: NeMo-RL's pad under PP (ours, or NeMo-RL's own where faster)
    plan_s: float
    won: str = "-"  # the passes where the switch ran NeMo-RL's own plan (train, logprob), or "-"

    def best(self) -> Figures:
        valid = [f for f in self.theirs.values() if not f.invalid]
        return min(valid or self.theirs.values(), key=lambda f: f.train)


def load_nemo_rl(tree: str | None) -> Any:
    if not tree or not os.path.isdir(os.path.join(tree, "nemo_rl")):
        raise SystemExit(f"bench.nemo_rl: no NeMo-RL tree at {tree!r}; {HOW}")
    sys.path.insert(0, os.path.abspath(tree))
    os.environ.setdefault("NO_VCS_VERSION", "1")
    from nemo_rl import package_info
    from nemo_rl.distributed import batched_data_dict

    return argparse.Namespace(BatchedDataDict=batched_data_dict.BatchedDataDict, version=package_info.__version__)


def run_cases(nemo: Any, workloads: Sequence[str], dps: Sequence[int], pps: Sequence[int]) -> list[Case]:
    cost_model = CostModel(**MODEL_DIMS)
    cases = []
    for workload in workloads:
        for dp in dps:
            n = PROMPTS_PER_DP_RANK * GROUP_SIZE * dp
            lengths = np.minimum(make_lengths(WORKLOADS[workload], n, SEED), MAX_LENGTH).astype(np.int64)
            for pp in pps:
                print(f"... {workload}, dp {dp}, pp {pp}: {n} rows", file=sys.stderr, flush=True)
                theirs, passes = {}, {}
                for setting in SETTINGS:
                    if setting == "dynamic" and pp > 1:  # NeMo-RL's Policy refuses it under PP
                        continue
                    passes[setting] = [nemo_rl_pass(nemo, lengths, dp, pp, setting, fo, cost_model)
                                       for fo in (False, True)]
                    theirs[setting] = judge(*passes[setting], lengths, dp, pp, cost_model)
                valid = [k for k, f in theirs.items() if not f.invalid] or list(theirs)
                user = passes[min(valid, key=lambda k: theirs[k].train)]  # the user's setting: NeMo-RL's best
                (train, _, train_won), (logprob, _, logprob_won) = (
                    ours_pass(lengths, dp, pp, fo, cost_model, True, user[fo]) for fo in (False, True))
                padded = judge(train, logprob, lengths, dp, pp, cost_model)
                won = ",".join(name for name, w in (("train", train_won), ("logprob", logprob_won)) if w) or "-"
                (train, plan_s, _), (logprob, _, _) = (ours_pass(lengths, dp, pp, fo, cost_model, False)
                                                       for fo in (False, True))
                cases.append(Case(workload, dp, pp, theirs, judge(train, logprob, lengths, dp, pp, cost_model),
                                  padded, plan_s, won))
    return cases


def geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(np.asarray(values, dtype=np.float64)))))


def print_table(cases: list[Case]) -> None:
    cols = [*SETTINGS, "ours", "ours+pad"]
    print(f"{'workload':<9} {'dp':>2} {'pp':>2} | " + " | ".join(
        f"{c:>8}: {'train':>6} {'logprob':>7} {'comp/real':>9} {'mb/rank':>7} {'bad':>8}" for c in cols)
        + f" | {'ours/best':>9} {'plan s':>6} {'won':>13}")
    for c in cases:
        figs = {**c.theirs, "ours": c.ours, "ours+pad": c.padded}
        cells = []
        for col in cols:
            f = figs.get(col)
            if f is None:
                cells.append(f"{col:>8}: {'(refused by NeMo-RL under PP)':>42}")
                continue
            counts = ",".join(str(x) for x in sorted(set(f.counts)))
            cells.append(f"{col:>8}: {f.train / TFLOP:>6.1f} {f.logprob / TFLOP:>7.1f} {f.computed / f.real:>9.3f} "
                         f"{counts:>7} {f.invalid or '-':>8}")
        print(f"{c.workload:<9} {c.dp:>2} {c.pp:>2} | " + " | ".join(cells)
              + f" | {c.ours.train / c.best().train:>9.3f} {c.plan_s:>6.2f} {c.won:>13}")


def summarize(cases: list[Case]) -> bool:
    ok = True
    for pp in sorted({c.pp for c in cases}):
        at = [c for c in cases if c.pp == pp]
        ratio = geomean([c.ours.train / c.best().train for c in at])
        logprob = geomean([c.ours.logprob / min(f.logprob for f in c.theirs.values()) for c in at])
        padded = geomean([c.padded.train / c.best().train for c in at])
        padded_logprob = geomean([c.padded.logprob / min(f.logprob for f in c.theirs.values()) for c in at])
        goal = GOALS.get(pp)
        met = goal is None or ratio <= goal
        ok &= met
        print(f"pp {pp}: training pass, ours / NeMo-RL's best valid setting, geomean over {len(at)} cases = "
              f"{ratio:.3f} (goal <= {goal}: {'met' if met else 'MISSED'}); log-prob pass ours / NeMo-RL's best = "
              f"{logprob:.3f}; with the pad_to_longest opt-out (ours+pad) = {padded:.3f} (goal: "
              f"{'met' if goal is None or padded <= goal else 'MISSED'}), its log-prob pass {padded_logprob:.3f}")
    bad = {s: sum(1 for c in cases for k, f in c.theirs.items() if k == s and f.invalid) for s in SETTINGS}
    ours_bad = sum(1 for c in cases for f in (c.ours, c.padded) if f.invalid)
    print(f"invalid plans: NeMo-RL {bad}, ours {ours_bad} of {len(cases)} cases")
    return ok and ours_bad == 0


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="rl-like at dp 8 only (a smoke run)")
    ap.add_argument("--nemo-rl", default=os.environ.get("NEMO_RL_TREE"), help="a NeMo-RL tree ($NEMO_RL_TREE)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = ap.parse_args(argv)
    nemo = load_nemo_rl(args.nemo_rl)
    t = time.perf_counter()
    cases = run_cases(nemo, ["rl-like"] if args.quick else list(WORKLOADS), DP_SIZES[:1] if args.quick else DP_SIZES,
                      PP_SIZES)
    print(f"NeMo-RL {nemo.version} ({args.nemo_rl}); {PROMPTS_PER_DP_RANK} prompts x {GROUP_SIZE} per DP rank, "
          f"{GLOBAL_BATCHES} global batches per training pass, lengths <= {MAX_LENGTH}; train_mb_tokens "
          f"{TRAIN_MB_TOKENS}, logprob_mb_tokens {LOGPROB_MB_TOKENS}, rows rounded to {PAD}; Qwen3-8B-like FLOPs "
          f"({time.perf_counter() - t:.0f} s)")
    print_table(cases)
    ok = summarize(cases)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
