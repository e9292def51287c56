"""Megatron-RL's own sequence packing next to slime-ext's plan, on the same rollout collections (issue 28, item 4).

    MEGATRON_LM_TREE=/path/to/Megatron-LM PYTHONPATH=$PWD python3.12 -m bench.megatron_rl
    PYTHONPATH=$PWD python3.12 -m bench.megatron_rl --megatron-lm /path/to/Megatron-LM [--quick] [--strict]

``MEGATRON_LM_TREE`` (or ``--megatron-lm``) is a Megatron-LM checkout or extracted tree (``git archive``): the
``megatron/rl`` package is not in the ``megatron-core`` wheel. It is put first on ``sys.path``; Megatron-LM HEAD
needs Python >= 3.12 and ``megatron.rl``'s imports (pydantic, triton, ...: docs/megatron-rl.md). ``--quick``: one
workload at dp 8 (a smoke run); ``--strict``: exit 1 when a goal is missed.

**Megatron-RL's plan** (``--rl-use-sequence-packing``), from Megatron-LM's own functions, imported from the tree at
run time (nothing of it is copied here), on the collection's rows in collection order (what
``pack_all_trajectories`` all-gathers):

1. ``SequencePacker.pack_sequences``: bins of exactly ``seq_length`` tokens (``--rl-sequence-packing-max-sequences-
   per-bin`` = 50, the flag's default); the row lengths are read back by its ``get_actual_sequence_lengths``;
2. ``distribute_packed_bins`` for ``fifo`` and ``round-robin``, called once per DP rank (every rank padded to the
   same bin count with empty bins);
3. ``create_packed_seq_params_for_bin``: each bin's ``cu_seqlens``, i.e. what its attention computes (the real
   sequences plus the trailing padding as one segment attending to itself; an empty bin gets ``None`` and
   ``train_rl.forward_step`` then runs it as one causal sequence of ``seq_length``);
4. the step split: ``update_microbatch_calculator`` sets megatron-core's own micro-batch calculator to
   ``L = ceil(ratio * bins_this_rank)`` bins per step (``ratio = global_batch_size / rows``), and
   ``get_microbatch_dataloader`` wrapped in ``itertools.cycle``, as ``prepare_data_for_update`` returns it, gives
   step ``k`` the positions ``[kL, (k+1)L)`` of the rank's bins, cyclically: where ``L`` overshoots, the last step
   trains the first bins again. (:func:`cycled_steps` states this in our words; the bench checks the two agree.)

Calling these in one process needs stand-ins for ``mpu`` (the DP rank and world size, CP size 1) and
``get_tokenizer().pad``, set on the module for the call and restored after (:func:`stand_ins`);
``pack_all_trajectories`` itself is not called (it all-gathers over a process group and moves to CUDA): its two
steps are called as it calls them. **slime-ext's plan**:
:func:`slime_ext.integrations.megatron_rl.plan.plan_collection`, the plan the integration runs, with the cap
``seq_length``.

**Pricing**: slime-ext's pipeline model and pricing (:func:`slime_ext.schedule.pipeline_pricing`, as bench/verl.py):
forward FLOPs of Qwen3-8B-like dims (:mod:`bench.workloads`), every micro-batch charged 2% of a full one
(``seq_length`` tokens at the linear rate), backward = 2 x forward, 1F1B at pp 4 with the output layer on the last
stage as slime-ext splits the stages; pp 1 is the same pricing with one stage. A Megatron-RL bin computes all
``seq_length`` tokens through every linear layer and the LM head, and causal attention within each ``cu_seqlens``
segment (:func:`bin_cost`); a slime-ext micro-batch computes its real tokens only (:func:`micro_batch_cost`).

**Columns** (one pass over the collection, ``grpo_iterations = 1``):

* ``step time``: the predicted time of the collection's optimizer steps, **summed over its steps** (each step: its
  slowest DP replica's makespan, the micro-batches in the order each plan runs them), in TFLOP of one GPU's work
  (divide by a GPU's achieved TFLOP/s for seconds); ``ours/best``: slime-ext's over Megatron-RL's better algorithm;
* ``log-prob pass``: one forward-only pass over the collection (old policy, or reference), the slowest DP rank's:
  Megatron-RL calls the schedule once per bin (``num_microbatches=1``: at pp 4 each bin crosses the stages alone),
  slime-ext once for the collection, over all its micro-batches (:func:`forward_only_makespans`, megatron-core's
  non-interleaved forward-only schedule under the same p2p assumption as slime-ext's model); ``best/ours``:
  Megatron-RL's better algorithm's over slime-ext's (a speed-up);
* ``computed/real``: tokens computed by the training pass (every micro-batch, re-trained and empty bins included)
  over the collection's real tokens;
* ``mb/rank/step``: micro-batches per DP rank per optimizer step (the same on every rank);
* ``twice``, ``never``: samples trained twice (or more) in the pass, and samples not trained at all.

**Cases**: the rollout shapes of :data:`bench.workloads.ROLLOUT_SHAPES` (rl-like, bimodal, long tail); a GRPO
collection of prompts x 16 rows (64 prompts = 1024 rows at dp 8, 256 prompts = 4096 rows at dp 32), lengths clipped
to ``seq_length`` = 16384 (Megatron-RL's generation limit makes every rollout fit: ``prepare_trajectories`` asserts
it); pp 1 and 4; 1 and 4 optimizer steps per collection. The lengths are drawn independently (a GRPO group's
lengths are not correlated here). These are predictions of a model, not measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Callable, Iterator, Sequence

import numpy as np

from slime_ext.integrations.megatron_rl.plan import plan_collection
from slime_ext.schedule import CostModel, ParallelConfig, PipelinePricing, PipelineSpec, pipeline_pricing

from .runner import parser
from .verdict import verdict
from .workloads import MODEL_DIMS, ROLLOUT_SHAPES, make_lengths

SEQ_LENGTH = 16384
#: --rl-sequence-packing-max-sequences-per-bin's default (the SequencePacker class default, 16, is not used)
MAX_SEQUENCES_PER_BIN = 50
GROUP_SIZE = 16
#: GRPO prompts per collection per DP rank: 64 prompts x 16 = 1024 rows at dp 8, 4096 at dp 32
PROMPTS_PER_DP_RANK = 8
DP_SIZES = (8, 32)
PP_SIZES = (1, 4)
STEPS_PER_COLLECTION = (1, 4)
ALGOS = ("fifo", "round-robin")
SEED = 1
#: the issue's goals: predicted training step at most this share of Megatron-RL's better algorithm (geomean, pp 1 and
#: pp 4), log-prob passes at least this many times faster at pp 4 (geomean)
GOAL_STEP_RATIO = 0.85
GOAL_LOGPROB_SPEEDUP = 2.0
PAD, TOKEN = 0, 1
TFLOP = 1e12

NEEDS = ("Megatron-LM HEAD needs Python >= 3.12, and megatron.rl imports torch, pydantic, triton, tensorboard, wandb, "
         "tqdm, openai, fastapi, uvicorn (docs/megatron-rl.md); run with PYTHONPATH=<this repository>")
HOW = ("set MEGATRON_LM_TREE (or pass --megatron-lm) to a Megatron-LM checkout or extracted tree, e.g. `git clone "
       "https://github.com/NVIDIA/Megatron-LM` or `git --git-dir=<clone>/.git archive <rev> | tar -x -C <dir>`; "
       f"the megatron-core wheel has no megatron/rl. {NEEDS}")


# ------------------------------------------------------------------------------------------ pricing (pure pieces)
def bin_segments(seq_lengths: Sequence[int], seq_length: int) -> list[int]:
    """The attention segments of one Megatron-RL bin of ``seq_length`` tokens holding sequences of ``seq_lengths``:
    each sequence, then the trailing padding as one segment that attends to itself (none when the bin is full);
    an empty bin is one causal sequence of ``seq_length``. (What ``create_packed_seq_params_for_bin``'s
    ``cu_seqlens`` say, without context parallelism.)"""
    lengths = [int(x) for x in seq_lengths]
    if any(x < 1 for x in lengths) or sum(lengths) > seq_length:
        raise ValueError(f"sequences of {lengths} tokens do not fit a bin of {seq_length}")
    if not lengths:
        return [int(seq_length)]
    pad = seq_length - sum(lengths)
    return lengths + ([pad] if pad else [])


def segments_from_cu_seqlens(cu_seqlens: Sequence[int]) -> list[int]:
    """The segments of a ``cu_seqlens`` list (its zero-length ghost entries dropped)."""
    return [int(x) for x in np.diff(np.asarray(cu_seqlens, dtype=np.int64)) if x > 0]


def bin_cost(segments: Sequence[int], seq_length: int, cost_model: CostModel) -> float:
    """Forward FLOPs of one Megatron-RL bin: all ``seq_length`` tokens through every linear layer and the LM head,
    causal attention within each segment. The segments tile the bin, so that is the FLOPs model's cost of the
    segments as if each were a sample: ``linear * seq_length + quadratic * sum(segment**2)``."""
    if sum(int(x) for x in segments) != seq_length:
        raise ValueError(f"segments {list(segments)} do not tile a bin of {seq_length} tokens")
    return float(cost_model.flops(np.asarray(segments, dtype=np.int64)).sum())


def micro_batch_cost(slot_lengths: Sequence[int], tokens: int, cost_model: CostModel) -> float:
    """Forward FLOPs of one slime-ext micro-batch: its sequences (real tokens, each in its aligned slot), plus any
    tail padding (``tokens`` beyond the slots, for sequence parallelism) at the linear rate."""
    slots = np.asarray(slot_lengths, dtype=np.int64)
    extra = int(tokens) - int(slots.sum())
    if extra < 0:
        raise ValueError(f"a micro-batch of {tokens} tokens cannot hold slots of {slots.tolist()}")
    return float(cost_model.flops(slots).sum() + cost_model.coefficients()[0] * extra)


def cycled_steps(num_bins: int, samples_ratio_per_step: float, num_steps: int) -> list[list[int]]:
    """Megatron-RL's step split of one rank's ``num_bins`` bins, in our words: ``L = ceil(ratio * num_bins)`` bins
    per step, step ``k`` the positions ``[kL, (k+1)L)`` taken cyclically (the last step may re-train the first)."""
    per_step = math.ceil(samples_ratio_per_step * num_bins)
    return [[(k * per_step + i) % num_bins for i in range(per_step)] for k in range(num_steps)]


def pricing_for(dp: int, pp: int, cost_model: CostModel, cap: int) -> PipelinePricing:
    """slime-ext's pricing of a ``dp x pp`` layout; pp 1: the same pricing with one stage (as bench/verl.py)."""
    if pp > 1:
        return pipeline_pricing(ParallelConfig(dp_size=dp, pp_size=pp), cost_model, cap)
    two = pipeline_pricing(ParallelConfig(dp_size=dp, pp_size=2), cost_model, cap)
    return dataclasses.replace(two, spec=PipelineSpec(pp_size=1), scale=1.0, stage_share=None)  # one stage


def stage_forwards(pricing: PipelinePricing, mb_costs: np.ndarray) -> np.ndarray:
    """``(R, M)`` micro-batch costs -> ``(R, pp, M)``: each stage's forward time of each micro-batch, as the pricing
    splits it (no VPP)."""
    if pricing.spec.vpp_size != 1:
        raise ValueError("the forward-only model here is the non-interleaved schedule (vpp_size 1)")
    f, _ = pricing.stage_costs(np.atleast_2d(np.asarray(mb_costs, dtype=np.float64)))
    if f.ndim == 2:  # every stage alike
        return np.repeat(f[:, None, :], pricing.spec.pp_size, axis=1)
    return f


def forward_only_makespans(stage_f: np.ndarray) -> np.ndarray:
    """``(R, P, M)`` per-stage forward times, in run order -> ``(R,)`` makespans of megatron-core's non-interleaved
    schedule with ``forward_only=True``: stage ``s`` runs, per micro-batch, ``recv_forward`` (not on the first
    stage), the forward, ``send_forward`` (not on the last). As in :mod:`slime_ext.schedule.pipeline`, a transfer
    takes no time and starts when both sides have posted it: a send blocks until the next stage posts the matching
    receive, which it does once its own previous send is done."""
    f = np.asarray(stage_f, dtype=np.float64)
    if f.ndim != 3:
        raise ValueError(f"stage forwards must be (replicas, stages, micro-batches), got shape {f.shape}")
    replicas, stages, count = f.shape
    sent = np.zeros((stages, replicas))  # when each stage's latest send completed (it then posts its next receive)
    end = np.zeros((stages, replicas))
    for j in range(count):
        end = np.empty((stages, replicas))
        for s in range(stages):
            ready = sent[s] if s == 0 else np.maximum(sent[s], end[s - 1])
            end[s] = ready + f[:, s, j]
        done = np.empty((stages, replicas))
        done[-1] = end[-1]  # the last stage sends nothing: it posts its next receive when its forward ends
        for s in range(stages - 2, -1, -1):
            done[s] = np.maximum(end[s], sent[s + 1])  # stage s + 1 posts its receive of j once its send of j-1 is done
        sent = done
    return end.max(axis=0) if count else np.zeros(replicas)


# ------------------------------------------------------------------------------------------------- runs, figures
@dataclass(frozen=True)
class MicroBatch:
    samples: tuple[int, ...]  # collection row ids
    tokens: int  # tokens computed (a Megatron-RL bin: seq_length)
    flops: float  # forward FLOPs


@dataclass(frozen=True)
class Run:
    """One plan of a collection, as it runs: ``steps[s][r]``, DP rank ``r``'s micro-batches of optimizer step ``s``
    in run order; ``logprob_calls[r]``, rank ``r``'s schedule calls of one log-prob pass, each the forward FLOPs of
    its micro-batches in run order."""

    label: str
    steps: tuple[tuple[tuple[MicroBatch, ...], ...], ...]
    logprob_calls: tuple[tuple[tuple[float, ...], ...], ...]


@dataclass(frozen=True)
class Figures:
    step_time: float  # the collection's steps, summed; each its slowest replica's makespan
    logprob_time: float  # one log-prob pass, the slowest rank's
    computed_tokens: int
    real_tokens: int
    padding_tokens: int  # computed tokens that belong to no sample (bins' padding, empty bins)
    micro_batches: tuple[int, ...]  # per rank, per step
    trained_twice: int
    never_trained: int


def judge(run: Run, lengths: np.ndarray, pricing: PipelinePricing) -> Figures:
    """The figures of ``run`` on rows of ``lengths``, priced by ``pricing``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    times = np.zeros(len(lengths), dtype=np.int64)
    step_time, computed, counts = 0.0, 0, []
    for s, step in enumerate(run.steps):
        sizes = {len(rank) for rank in step}
        if len(sizes) != 1:
            raise AssertionError(f"{run.label}: step {s} has different micro-batch counts per rank: {sorted(sizes)}")
        counts.append(sizes.pop())
        costs = np.array([[mb.flops for mb in rank] for rank in step], dtype=np.float64)
        step_time += float(pricing.makespans(costs).max())
        for rank in step:
            for mb in rank:
                np.add.at(times, np.asarray(mb.samples, dtype=np.int64), 1)
                computed += mb.tokens
    logprob = max(sum(float(forward_only_makespans(stage_forwards(pricing, np.asarray(call)[None]))[0])
                      for call in calls) for calls in run.logprob_calls)
    return Figures(step_time=step_time, logprob_time=logprob, computed_tokens=computed,
                   real_tokens=int(lengths.sum()), padding_tokens=computed - int((times * lengths).sum()),
                   micro_batches=tuple(counts), trained_twice=int((times > 1).sum()),
                   never_trained=int((times == 0).sum()))


def ours_run(lengths: np.ndarray, dp: int, pp: int, num_steps: int, seq_length: int,
             cost_model: CostModel) -> tuple[Run, float]:
    """slime-ext's plan of the collection (the integration's :func:`plan_collection`) and its planning seconds."""
    t = time.perf_counter()
    plan = plan_collection(lengths, parallel=ParallelConfig(dp_size=dp, pp_size=pp), num_steps=num_steps,
                           cap=seq_length, cost_model=cost_model)
    seconds = time.perf_counter() - t
    slots = np.asarray(plan.slot_lengths, dtype=np.int64)
    steps = tuple(tuple(tuple(MicroBatch(mb, int(tokens), micro_batch_cost(slots[list(mb)], tokens, cost_model))
                              for mb, tokens in zip(plan.micro_batches[r][s], plan.micro_batch_tokens[r][s]))
                        for r in range(dp)) for s in range(num_steps))
    # the log-prob passes: one forward-only schedule call over all the collection's micro-batches, each rank in the
    # order the integration runs them (plan.logprob_order: the forward-only model's best)
    flops = [[mb.flops for s in range(num_steps) for mb in steps[s][r]] for r in range(dp)]
    calls = tuple(((*(flops[r][k] for k in plan.logprob_order[r]),),) for r in range(dp))
    return Run("ours", steps, calls), seconds


def megatron_rl_run(label: str, rank_bins: list[list[tuple[int, ...]]], rank_segments: list[list[list[int]]],
                    positions: list[list[int]], seq_length: int, cost_model: CostModel) -> Run:
    """Megatron-RL's run of its bins: step ``s`` runs the bins at ``positions[s]`` of every rank's list (its step
    split); a log-prob pass calls the schedule once per bin of the rank, empty bins included."""
    flops = [[bin_cost(seg, seq_length, cost_model) for seg in segments] for segments in rank_segments]
    steps = tuple(tuple(tuple(MicroBatch(bins[p], seq_length, costs[p]) for p in pos)
                        for bins, costs in zip(rank_bins, flops)) for pos in positions)
    calls = tuple(tuple((c,) for c in costs) for costs in flops)
    return Run(label, steps, calls)


# ----------------------------------------------------------------------------------- Megatron-LM, from its tree
@dataclass(frozen=True)
class MegatronLM:
    tree: Path
    version: str
    spu: ModuleType  # megatron.rl.sequence_packing_utils
    calculator: ModuleType  # megatron.core.num_microbatches_calculator


def load_megatron_lm(tree: str | None) -> MegatronLM:
    """Import Megatron-RL's packing module from ``tree`` (first on ``sys.path``); a clear ``SystemExit`` without."""
    if not tree:
        raise SystemExit(f"bench.megatron_rl runs Megatron-RL's own packing from a Megatron-LM tree: {HOW}")
    root = Path(tree).expanduser().resolve()
    if not (root / "megatron" / "rl" / "sequence_packing_utils.py").is_file():
        raise SystemExit(f"bench.megatron_rl: {root} has no megatron/rl/sequence_packing_utils.py (not a Megatron-LM "
                         f"tree with Megatron-RL, which ships from core_v0.16.1 on); {HOW}")
    sys.path.insert(0, str(root))
    try:
        with contextlib.redirect_stdout(sys.stderr):  # megatron.rl prints on import; keep stdout for the table
            import megatron.core.num_microbatches_calculator as calculator
            import megatron.core.package_info as info
            import megatron.rl.sequence_packing_utils as spu
    except Exception as exc:  # an import of the host's own: say what is missing and how to get it
        raise SystemExit(f"bench.megatron_rl: Megatron-LM at {root} does not import under Python "
                         f"{sys.version.split()[0]}: {type(exc).__name__}: {exc}; {NEEDS}") from exc
    if not Path(spu.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"bench.megatron_rl: megatron.rl came from {spu.__file__}, not from {root}: another "
                         f"Megatron-LM shadows it on sys.path; {HOW}")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO lines (the plan, per call) drown the table
    return MegatronLM(root, str(info.__version__), spu, calculator)


@contextlib.contextmanager
def stand_ins(spu: ModuleType, rank: int, world: int) -> Iterator[None]:
    """For the call: ``mpu`` answers DP ``rank`` of ``world`` (no context parallelism), ``get_tokenizer().pad`` is
    :data:`PAD`. Megatron-RL runs these functions in ``world`` processes; the bench calls them once per rank."""
    saved = spu.mpu, spu.get_tokenizer
    spu.mpu = SimpleNamespace(get_data_parallel_rank=lambda: rank, get_data_parallel_world_size=lambda: world,
                              get_context_parallel_world_size=lambda: 1, get_data_parallel_group=lambda: None)
    spu.get_tokenizer = lambda: SimpleNamespace(pad=PAD)
    try:
        yield
    finally:
        spu.mpu, spu.get_tokenizer = saved


def _accepted(fn: Callable, **kwargs) -> dict:
    """The keywords ``fn`` takes (``seq_length_multiple`` exists at HEAD, not in core_v0.19.0)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def megatron_rl_pack(mlm: MegatronLM, lengths: np.ndarray, seq_length: int):
    """``SequencePacker.pack_sequences`` on the collection's rows (real tokens, then pad to ``seq_length``)."""
    import torch

    lengths_t = torch.as_tensor(np.asarray(lengths, dtype=np.int64))
    trajs = (torch.arange(seq_length)[None, :] < lengths_t[:, None]).to(torch.uint8) * TOKEN  # pad = 0
    packer = mlm.spu.SequencePacker(**_accepted(mlm.spu.SequencePacker.__init__, bin_size=seq_length, pad_token=PAD,
                                                max_sequences_per_bin=MAX_SEQUENCES_PER_BIN, seq_length_multiple=1))
    packed = packer.pack_sequences(trajs, None)
    if [int(x) for x in packed[3].seq_lengths] != [int(x) for x in lengths]:
        raise AssertionError("Megatron-RL's get_actual_sequence_lengths read other lengths than the rows'")
    return packed


def megatron_rl_distribute(mlm: MegatronLM, packed, dp: int, algo: str, seq_length: int):
    """``distribute_packed_bins`` for every DP rank: each rank's bins (row ids; empty bins ``()``) and each bin's
    attention segments from Megatron-RL's ``create_packed_seq_params_for_bin`` (checked against
    :func:`bin_segments`)."""
    import torch

    spu = mlm.spu
    trajs, position_ids, loss_mask, info = packed
    lengths = info.seq_lengths
    rank_bins, rank_segments = [], []
    for rank in range(dp):
        info.packing_algo = algo  # as pack_all_trajectories sets it
        with stand_ins(spu, rank, dp):
            local = spu.distribute_packed_bins(trajs, position_ids, loss_mask, info)[3]
        bins = [tuple(int(i) for i in b) for b in local.bin_seq_indices]
        segments = []
        for b, members in enumerate(bins):
            params = spu.create_packed_seq_params_for_bin(**_accepted(
                spu.create_packed_seq_params_for_bin, packing_info=local, bin_idx=b, bin_size=seq_length,
                max_sequences_per_bin=MAX_SEQUENCES_PER_BIN, device=torch.device("cpu"), seq_length_multiple=1))
            seg = [seq_length] if params is None else segments_from_cu_seqlens(params.cu_seqlens_q.tolist())
            if seg != bin_segments([lengths[i] for i in members], seq_length):
                raise AssertionError(f"rank {rank} bin {b}: Megatron-RL's cu_seqlens give segments {seg}, "
                                     f"bin_segments says otherwise")
            segments.append(seg)
        rank_bins.append(bins)
        rank_segments.append(segments)
    if len({len(b) for b in rank_bins}) != 1:
        raise AssertionError(f"{algo}: ranks hold different bin counts {[len(b) for b in rank_bins]}")
    return rank_bins, rank_segments


def megatron_rl_positions(mlm: MegatronLM, rank_bins: list[list[tuple[int, ...]]], global_batch_size: int,
                          rows: int, num_steps: int) -> list[list[int]]:
    """Megatron-RL's step split, from its own functions: ``update_microbatch_calculator`` (megatron-core's
    calculator, set up for the call and torn down after) gives the bins per step, ``get_microbatch_dataloader`` in
    ``itertools.cycle`` (as ``prepare_data_for_update`` returns it) the bins each step draws. Every rank holds the
    same bin count, so the positions are every rank's. Checked against :func:`cycled_steps`."""
    spu, calc = mlm.spu, mlm.calculator
    dp, num_bins = len(rank_bins), len(rank_bins[0])
    ratio = global_batch_size / rows  # samples_ratio_per_step, as prepare_data_for_update computes it
    calc.init_num_microbatches_calculator(rank=0, rampup_batch_size=None, global_batch_size=dp, micro_batch_size=1,
                                          data_parallel_size=dp, decrease_batch_size_if_needed=False)
    try:
        with stand_ins(spu, 0, dp):
            spu.update_microbatch_calculator(samples_ratio_per_step=ratio, num_bins_this_rank=num_bins,
                                             bin_seq_indices=[list(b) for b in rank_bins[0]],
                                             global_batch_size=global_batch_size, micro_batch_size=1,
                                             decrease_batch_size_if_needed=False)
        per_step = calc.get_num_microbatches()
        loader = itertools.cycle(spu.get_microbatch_dataloader(num_bins, 1))
        positions = [[int(next(loader)[0]) for _ in range(per_step)] for _ in range(num_steps)]
    finally:
        calc.destroy_num_microbatches_calculator()
    if positions != cycled_steps(num_bins, ratio, num_steps):
        raise AssertionError(f"Megatron-RL's step split {positions} is not cycled_steps'")
    return positions


# ------------------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    workload: str
    dp: int
    pp: int
    steps: int
    algos: dict  # algorithm -> Figures
    ours: Figures
    plan_s: float

    def best(self, what: str) -> float:
        return min(getattr(f, what) for f in self.algos.values())


def collection(workload: str, dp: int, seq_length: int) -> np.ndarray:
    rows = PROMPTS_PER_DP_RANK * dp * GROUP_SIZE
    return np.minimum(make_lengths(ROLLOUT_SHAPES[workload], rows, SEED), seq_length).astype(np.int64)


def run_cases(mlm: MegatronLM, workloads: Sequence[str], dps: Sequence[int], pps: Sequence[int],
              steps_per_collection: Sequence[int], seq_length: int = SEQ_LENGTH,
              progress: Callable[[str], None] = lambda s: None) -> list[Case]:
    cost_model = CostModel(**MODEL_DIMS)
    cases = []
    for workload in workloads:
        for dp in dps:
            lengths = collection(workload, dp, seq_length)
            progress(f"{workload}, dp {dp}: {len(lengths)} rows, Megatron-RL packing")
            packed = megatron_rl_pack(mlm, lengths, seq_length)
            bins = {algo: megatron_rl_distribute(mlm, packed, dp, algo, seq_length) for algo in ALGOS}
            del packed
            for num_steps in steps_per_collection:
                gbs = len(lengths) // num_steps
                runs = {}
                for algo, (rank_bins, segments) in bins.items():
                    positions = megatron_rl_positions(mlm, rank_bins, gbs, len(lengths), num_steps)
                    runs[algo] = megatron_rl_run(algo, rank_bins, segments, positions, seq_length, cost_model)
                for pp in pps:
                    pricing = pricing_for(dp, pp, cost_model, seq_length)
                    ours, plan_s = ours_run(lengths, dp, pp, num_steps, seq_length, cost_model)
                    cases.append(Case(workload, dp, pp, num_steps,
                                      {algo: judge(run, lengths, pricing) for algo, run in runs.items()},
                                      judge(ours, lengths, pricing), plan_s))
    return cases


def geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(np.asarray(values, dtype=np.float64)))))


def _counts(counts: tuple[int, ...]) -> str:
    return str(counts[0]) if len(set(counts)) == 1 else ",".join(map(str, counts))


def print_table(cases: list[Case]) -> None:
    fifo, rr = ALGOS
    print(f"{'':<9} {'':>2} {'':>2} {'':>2} | {'step time, TFLOP per GPU':^33} | {'log-prob pass, TFLOP/GPU':^31} | "
          f"{'computed/real':^17} | {'mb/rank/step':^19} | {'twice':^11} | {'never':>5} | {'plan':>5}")
    print(f"{'workload':<9} {'dp':>2} {'pp':>2} {'st':>2} | {'fifo':>7} {'rr':>7} {'ours':>7} {'ours/best':>9} | "
          f"{'fifo':>7} {'rr':>7} {'ours':>6} {'best/ours':>8} | {'fifo':>5} {'rr':>5} {'ours':>5} | "
          f"{'fifo':>3} {'rr':>3} {'ours':>11} | {'fifo':>4} {'rr':>3} {'ours':>2} | {'all':>5} | {'s':>5}")
    for c in cases:
        f, r, o = c.algos[fifo], c.algos[rr], c.ours
        never = f.never_trained + r.never_trained + o.never_trained
        print(f"{c.workload:<9} {c.dp:>2} {c.pp:>2} {c.steps:>2} | {f.step_time / TFLOP:>7.1f} "
              f"{r.step_time / TFLOP:>7.1f} {o.step_time / TFLOP:>7.1f} {o.step_time / c.best('step_time'):>9.3f} | "
              f"{f.logprob_time / TFLOP:>7.1f} {r.logprob_time / TFLOP:>7.1f} {o.logprob_time / TFLOP:>6.1f} "
              f"{c.best('logprob_time') / o.logprob_time:>8.2f} | "
              f"{f.computed_tokens / f.real_tokens:>5.3f} {r.computed_tokens / r.real_tokens:>5.3f} "
              f"{o.computed_tokens / o.real_tokens:>5.3f} | {_counts(f.micro_batches):>3} "
              f"{_counts(r.micro_batches):>3} {_counts(o.micro_batches):>11} | {f.trained_twice:>4} "
              f"{r.trained_twice:>3} {o.trained_twice:>2} | {never:>5} | {c.plan_s:>5.2f}")


def summarize(cases: list[Case]) -> bool:
    """Print the geomeans and the goals; True when every goal is met."""
    ok = True

    def met(passed: bool, cases: int) -> str:
        nonlocal ok
        ok &= passed or not cases
        return verdict(passed, cases, "no case")

    for pp in sorted({c.pp for c in cases}):
        at = [c for c in cases if c.pp == pp]
        best = geomean([c.ours.step_time / c.best("step_time") for c in at])
        by_algo = ", ".join(f"{a} {geomean([c.algos[a].step_time / c.ours.step_time for c in at]):.3f}x"
                            for a in ALGOS)
        print(f"pp {pp}: training step, ours / Megatron-RL's better algorithm, geomean over {len(at)} cases = "
              f"{best:.3f} (goal <= {GOAL_STEP_RATIO}: {met(best <= GOAL_STEP_RATIO, len(at))}); Megatron-RL / "
              f"ours by algorithm: {by_algo}")
        speedup = geomean([c.best("logprob_time") / c.ours.logprob_time for c in at])
        goal = (f" (goal >= {GOAL_LOGPROB_SPEEDUP:g}x: {met(speedup >= GOAL_LOGPROB_SPEEDUP, len(at))})"
                if pp > 1 else " (no goal at pp 1)")
        print(f"pp {pp}: log-prob pass, Megatron-RL's better algorithm / ours, geomean = {speedup:.2f}x{goal}")
    padding = sum(c.ours.padding_tokens for c in cases)
    twice = sum(c.ours.trained_twice for c in cases)
    never = sum(c.ours.never_trained for c in cases)
    print(f"ours over all {len(cases)} cases: padding tokens {padding} (goal 0: {met(padding == 0, len(cases))}), "
          f"samples trained twice {twice} (goal 0: {met(twice == 0, len(cases))}), samples never trained {never} "
          f"({met(never == 0, len(cases))})")
    for algo in ALGOS:
        fig = [c.algos[algo] for c in cases]
        computed = sum(f.computed_tokens for f in fig)
        print(f"Megatron-RL {algo} over all cases: padding tokens {sum(f.padding_tokens for f in fig)} "
              f"({sum(f.padding_tokens for f in fig) / computed:.1%} of the computed), samples trained twice "
              f"{sum(f.trained_twice for f in fig)}, never trained {sum(f.never_trained for f in fig)}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, quick="rl-like at dp 8 only (a smoke run)")
    ap.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_TREE"),
                    help="a Megatron-LM tree (default: $MEGATRON_LM_TREE)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = ap.parse_args(argv)
    mlm = load_megatron_lm(args.megatron_lm)
    workloads = ["rl-like"] if args.quick else list(ROLLOUT_SHAPES)
    dps = DP_SIZES[:1] if args.quick else DP_SIZES
    t = time.perf_counter()
    cases = run_cases(mlm, workloads, dps, PP_SIZES, STEPS_PER_COLLECTION,
                      progress=lambda s: print(f"... {s}", file=sys.stderr, flush=True))
    print(f"Megatron-LM {mlm.version} ({mlm.tree}); seq_length {SEQ_LENGTH}, at most {MAX_SEQUENCES_PER_BIN} "
          f"sequences per bin; {PROMPTS_PER_DP_RANK} prompts x {GROUP_SIZE} per DP rank per collection; Qwen3-8B-like "
          f"FLOPs, 2% per micro-batch, backward 2x forward; step time summed over the collection's steps "
          f"({time.perf_counter() - t:.0f} s)")
    print_table(cases)
    ok = summarize(cases)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    raise SystemExit(main())
