"""Upstream slime's two schemes in our own words: the one legacy implementation, and the reference planner.

Upstream code (THUDM/slime) was read as reference only; this is our own code for the same algorithms, with the same
behaviour and tie-breaking, deliberately not vectorised: the point is to measure what upstream costs. Where upstream
has a quirk we keep it and say so. The benchmark (``bench/run.py``), ``slime-ext plan --compare`` and the runtime
legacy path (``dp_schedule: legacy``, :mod:`slime_ext.training.legacy_backend`) all use this module.

* ``seqlen_balancing``  -- ``karmarkar_karp`` (sets/states in a ``heapq``, as in ``slime/utils/seqlen_balancing.py``,
  itself from verl), ``get_seqlen_balanced_partitions``, the quadratic ``first_fit_pack``,
  ``expand_bins_by_splitting``.
* ``flops_utils``       -- ``calculate_fwd_flops`` for a dense model (``slime/utils/flops_utils.py``), as the one
  formula's upstream variant (``CostModel.flops(..., formula="upstream")``).
* (a) :func:`legacy_schedule` -- the training-side scheme: the rollout side splits samples across DP ranks
  (``_split_train_data_by_dp``: strided, or equal-size KK on ``total_lengths`` with ``balance_data``); every rank
  then runs ``get_data_iterator``: per local step a first-fit count (``get_minimum_num_micro_batch_size``),
  ``dist.all_reduce(MAX)`` over the ranks (simulated in-process), VPP rounding (down, as upstream), and KK of the
  step's samples into that many micro-batches with no cap. It has no ``balance_by_flops``.
* (b) :func:`reference_schedule` -- the rollout-side ``build_dp_schedule`` with ``_pack_step_into_mbs``: per step,
  unsorted first fit (or, with ``balance_by_flops``, KK of the samples' FLOPs into ``ceil(tokens / cap)`` bins
  with no cap), split-to-align, then strided or equal-size KK of the micro-batches' FLOPs over the ranks.

Both return :class:`BaselineSchedule`: the same shape as our ``DPSchedule`` (``partitions[r]`` in micro-batch
order, ``micro_batch_indices[r]`` tiling it, ``num_microbatches[s]``), so one metrics function measures all three.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Sequence

from slime_ext.schedule import CostModel


@dataclass
class BaselineSchedule:
    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]
    #: legacy only: seconds of each phase (the rollout-side split, then per rank: count, then KK)
    timings: dict[str, Any] = field(default_factory=dict)


# ================================================================================================ seqlen_balancing
class _Group:
    """One group of a partial solution. Groups order by sum, then member count, then the ``(index, weight)``
    members -- upstream's order. Kept as Python objects compared in Python, one member appended at a time, so that
    the benchmark pays what upstream pays for the same work."""

    __slots__ = ("total", "members")

    def __init__(self, members: list[tuple[int, Any]]):
        self.members = members
        self.total = sum(w for _, w in members)

    def take(self, other: "_Group") -> None:
        for member in other.members:
            self.members.append(member)
            self.total += member[1]

    def __lt__(self, other: "_Group") -> bool:
        if self.total != other.total:
            return self.total < other.total
        if len(self.members) != len(other.members):
            return len(self.members) < len(other.members)
        return self.members < other.members


class _Partial:
    """A partial largest-differencing solution: ``k`` groups, heaviest first."""

    __slots__ = ("groups",)

    def __init__(self, groups: list[_Group]):
        self.groups = sorted(groups, reverse=True)

    def spread(self):
        return self.groups[0].total - self.groups[-1].total

    def absorb(self, other: "_Partial") -> None:
        """Give this solution's i-th heaviest group the other's i-th lightest, then re-sort."""
        for mine, theirs in zip(self.groups, reversed(other.groups)):
            mine.take(theirs)
        self.groups = sorted(self.groups, reverse=True)

    def __lt__(self, other: "_Partial") -> bool:
        """Heap order: the widest spread first; on a tie, the heavier heaviest group."""
        mine, theirs = self.spread(), other.spread()
        if mine != theirs:
            return mine > theirs
        return other.groups[0] < self.groups[0]


def karmarkar_karp(weights: Sequence, k: int, equal_size: bool) -> list[list[int]]:
    """Largest differencing over ``k`` groups, heaviest group first (equal member counts with ``equal_size``).

    Items are taken in increasing ``(weight, index)`` order, one per seed solution (or, with ``equal_size``, ``k``
    per seed, one in each group); while more than one solution is left, the two with the widest spread are merged.
    Behaves as upstream's ``seqlen_balancing.karmarkar_karp`` (same seeds, heap order and tie-breaks).
    """
    n = len(weights)
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(weights) % k == 0, got {n} % {k}")
    ranked = sorted((w, i) for i, w in enumerate(weights))
    width = k if equal_size else 1
    heap: list[_Partial] = []
    for first in range(0, n, width):
        seed = [_Group([(i, w)]) for w, i in ranked[first:first + width]]
        heapq.heappush(heap, _Partial(seed + [_Group([]) for _ in range(k - len(seed))]))
    while len(heap) > 1:
        widest = heapq.heappop(heap)
        widest.absorb(heapq.heappop(heap))
        heapq.heappush(heap, widest)
    return [[i for i, _ in group.members] for group in heap[0].groups]


def get_seqlen_balanced_partitions(seqlen_list: Sequence, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """:func:`karmarkar_karp`, checked (``k`` non-empty groups covering every index) and each group sorted."""
    if len(seqlen_list) < k_partitions:
        raise ValueError(f"{len(seqlen_list)} items cannot fill k_partitions={k_partitions} groups")
    groups = [sorted(g) for g in karmarkar_karp(seqlen_list, k_partitions, equal_size)]
    if any(not g for g in groups) or sorted(i for g in groups for i in g) != list(range(len(seqlen_list))):
        raise ValueError("karmarkar_karp returned an empty group or lost an item")
    return groups


def first_fit_pack(total_lengths: Sequence[int], max_tokens_per_bin: int) -> list[list[int]]:
    """Arrival-order first fit, scanning every open bin (quadratic); an oversize sample opens a bin alone."""
    bins: list[list[int]] = []
    bin_sums: list[int] = []
    for idx, length in enumerate(total_lengths):
        for j in range(len(bins)):
            if bin_sums[j] + length <= max_tokens_per_bin:
                bins[j].append(idx)
                bin_sums[j] += length
                break
        else:
            bins.append([idx])
            bin_sums.append(length)
    return bins


def _split_bin_by_tokens(bin_indices: list[int], lengths: Sequence[int]) -> list[list[int]]:
    halves: list[list[int]] = [[], []]
    sums = [0, 0]
    for idx in sorted(bin_indices, key=lambda i: -lengths[i]):
        h = 0 if sums[0] <= sums[1] else 1
        halves[h].append(idx)
        sums[h] += lengths[idx]
    return halves


def expand_bins_by_splitting(bins: list[list[int]], target_count: int, lengths: Sequence[int]) -> None:
    """Grow ``bins`` in place by halving the largest multi-sample bin (rescanning all bins every split)."""
    while len(bins) < target_count:
        candidates = [(sum(lengths[i] for i in b), idx) for idx, b in enumerate(bins) if len(b) > 1]
        if not candidates:
            break
        _, idx = max(candidates)  # ties: the later bin
        left, right = _split_bin_by_tokens(bins[idx], lengths)
        bins[idx] = left
        bins.append(right)


# ================================================================================================ flops_utils
def _upstream_cost_model(args: Any) -> CostModel:
    dims = {k: getattr(args, k) for k in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                                          "kv_channels", "ffn_hidden_size", "vocab_size")}
    return CostModel(**dims, swiglu=True)


def calculate_fwd_flops(seqlens: Sequence[int], args: Any) -> float:
    """Upstream's ``calculate_fwd_flops`` (dense, gated MLP): the one formula, ``CostModel(formula="upstream")``."""
    return float(_upstream_cost_model(args).flops(seqlens, "upstream").sum())


def _calculate_workloads(step_lengths: Sequence[int], args: Any) -> list[float]:
    """FLOPs per sample; evaluated one sample at a time in plain Python, as upstream does."""
    linear, quadratic = _upstream_cost_model(args).coefficients("upstream")
    return [length * (linear + quadratic * length) for length in step_lengths]


# ================================================================================================ (b) reference
def _pack_step_into_mbs(step_lengths: list[int], *, args: Any, max_per_bin: int | None) -> list[list[int]]:
    if args.use_dynamic_batch_size:
        if args.balance_by_flops:
            total_tokens = sum(step_lengths)
            num_mbs = max(1, (total_tokens + max_per_bin - 1) // max_per_bin)
            if num_mbs >= len(step_lengths):
                return [[i] for i in range(len(step_lengths))]
            workloads = _calculate_workloads(step_lengths, args)
            return get_seqlen_balanced_partitions(workloads, num_mbs, equal_size=False)  # no token cap
        return first_fit_pack(step_lengths, max_per_bin)
    n = len(step_lengths)
    mbs = args.micro_batch_size
    return [list(range(i, min(i + mbs, n))) for i in range(0, n, mbs)]


def reference_schedule(
    args: Any,
    train_parallel_config: dict,
    total_lengths: Sequence[int],
    *,
    global_batch_size: int,
    rollout_indices: Sequence[int],
) -> BaselineSchedule:
    """Baseline (b): upstream's rollout-side ``build_dp_schedule`` (pack first, distribute second)."""
    dp_size = train_parallel_config["dp_size"]
    cp_size = train_parallel_config["cp_size"]
    vpp_size = train_parallel_config["vpp_size"]
    mb_group = train_parallel_config["microbatch_group_size_per_vp_stage"]
    max_per_bin = args.max_tokens_per_gpu * cp_size if args.use_dynamic_batch_size else None
    align_to = dp_size * (mb_group if vpp_size > 1 else 1)

    rollout_id_to_samples: dict[int, list[int]] = {}
    for pos, rid in enumerate(rollout_indices):
        rollout_id_to_samples.setdefault(rid, []).append(pos)
    rollout_ids = list(rollout_id_to_samples.keys())
    num_steps = len(rollout_ids) // global_batch_size
    assert num_steps >= 1

    partitions: list[list[int]] = [[] for _ in range(dp_size)]
    micro_batch_indices: list[list[list[int]]] = [[] for _ in range(dp_size)]
    num_microbatches: list[int] = []
    for step_i in range(num_steps):
        step_rollouts = rollout_ids[step_i * global_batch_size:(step_i + 1) * global_batch_size]
        sample_indices = [pos for rid in step_rollouts for pos in rollout_id_to_samples[rid]]
        step_lengths = [total_lengths[i] for i in sample_indices]
        assert len(sample_indices) >= dp_size

        # 1. pack (local indices into sample_indices)
        step_mbs = _pack_step_into_mbs(step_lengths, args=args, max_per_bin=max_per_bin)
        # 2. align by splitting the largest multi-sample bins
        target_k = max(((len(step_mbs) + align_to - 1) // align_to) * align_to, align_to)
        if target_k != len(step_mbs):
            assert args.use_dynamic_batch_size, "static path: num_mbs is not a multiple of dp_size * mb_group"
            expand_bins_by_splitting(step_mbs, target_k, step_lengths)
            assert len(step_mbs) == target_k, "dynamic path: too few samples to split to the alignment"
        k = len(step_mbs)
        num_microbatches.append(k // dp_size)
        # 3. distribute: equal-size KK on micro-batch FLOPs, or strided
        if args.balance_data:
            step_workloads = _calculate_workloads(step_lengths, args)
            mbs_weights = [sum(step_workloads[i] for i in bin_) for bin_ in step_mbs]
            rank_mbs_idx = get_seqlen_balanced_partitions(mbs_weights, dp_size, equal_size=True)
        else:
            rank_mbs_idx = [list(range(r, k, dp_size)) for r in range(dp_size)]
        # 4. per-rank partitions and local micro-batch indices
        for r in range(dp_size):
            for mbs_idx in rank_mbs_idx[r]:
                mbs_locals = step_mbs[mbs_idx]
                start = len(partitions[r])
                partitions[r].extend(sample_indices[i] for i in mbs_locals)
                micro_batch_indices[r].append(list(range(start, start + len(mbs_locals))))
    return BaselineSchedule(partitions, micro_batch_indices, num_microbatches)


# ================================================================================================ (a) legacy
# The rollout side splits samples over DP ranks; each rank then plans its own micro-batches (``get_data_iterator``:
# :func:`legacy_rank_plan`). The runtime legacy path (:class:`slime_ext.training.legacy_backend.LegacyPath`) and the
# run-config pre-check call ``legacy_rank_plan`` too, the runtime with a real all-reduce as its ``reduce_max``.
def split_train_data_by_dp(total_lengths: Sequence[int], dp_size: int, balance_data: bool) -> list[list[int]]:
    """Legacy rollout side: which global samples each DP rank gets (the whole rollout at once, not per step)."""
    if balance_data:
        use_equal_size = len(total_lengths) % dp_size == 0  # upstream falls back to unequal sizes
        return get_seqlen_balanced_partitions(total_lengths, dp_size, equal_size=use_equal_size)
    return [list(range(i, len(total_lengths), dp_size)) for i in range(dp_size)]


def get_minimum_num_micro_batch_size(total_lengths: Sequence[int], max_tokens_per_gpu: int) -> int:
    """First-fit bin count (sums only), as the legacy training side computes it per rank and step."""
    batches: list[int] = []
    for length in total_lengths:
        for i in range(len(batches)):
            if batches[i] + length <= max_tokens_per_gpu:
                batches[i] += length
                break
        else:
            batches.append(length)
    return len(batches)


def legacy_step_counts(local_lengths: Sequence[int], num_local_gbs: int, cap: int) -> list[int]:
    """This rank's first-fit count of each local step (``num_local_gbs`` samples each); all-reduced MAX next."""
    num_steps = len(local_lengths) // num_local_gbs
    return [get_minimum_num_micro_batch_size(local_lengths[i * num_local_gbs:(i + 1) * num_local_gbs], cap)
            for i in range(num_steps)]


def round_for_vpp(counts: Sequence[int], vpp_size: int, group: int) -> list[int]:
    """Upstream's VPP rounding: DOWN to a multiple of ``microbatch_group_size_per_vp_stage``, at least 1.

    Decided once, here, for the benchmark, ``plan --compare`` and the runtime: rounding down is what upstream runs
    (fewer, fuller micro-batches -- KK below has no cap). Where it clamps to 1 below a whole group, Megatron's
    interleaved schedule cannot run the result; the runtime refuses that step instead of rounding differently.
    """
    if vpp_size <= 1:
        return list(counts)
    return [max(1, c // group * group) for c in counts]


def legacy_micro_batches(local_lengths: Sequence[int], num_local_gbs: int, counts: Sequence[int]) -> list[list[int]]:
    """KK of each local step into ``counts[s]`` micro-batches, no cap; local indices into the rank's samples."""
    micro_batch_indices: list[list[int]] = []
    for s, num_mbs in enumerate(counts):
        start = s * num_local_gbs
        groups = get_seqlen_balanced_partitions(local_lengths[start:start + num_local_gbs], num_mbs, equal_size=False)
        micro_batch_indices.extend([start + i for i in g] for g in groups)
    return micro_batch_indices


class LegacyPlanError(ValueError):
    """The legacy path cannot plan a rank's samples; the message names the key, the value and the fix."""


def legacy_rank_plan(local_lengths: Sequence[int], *, global_batch_size: int, dp_size: int,
                     use_dynamic_batch_size: bool, micro_batch_size: int | None, cap: int | None, vpp_size: int = 1,
                     group: int = 1, reduce_max: Any = list) -> tuple[list[list[int]], list[int]]:
    """One rank's ``get_data_iterator``: ``(micro_batch_indices, num_microbatches)`` over its ``local_lengths``.

    Steps of ``global_batch_size / dp_size`` local samples (upstream's meaning: samples). Static: ``micro_batch_size``
    contiguous samples; dynamic: first-fit counts, ``reduce_max`` (the DP group's ``all_reduce(MAX)``), VPP rounding
    and KK with no cap. Where upstream would drop samples or hand Megatron's interleaved schedule a count that is not
    a whole ``microbatch_group_size_per_vp_stage``, :class:`LegacyPlanError` says so instead.
    """
    gbs = global_batch_size
    if gbs % dp_size:
        raise LegacyPlanError(f"global_batch_size={gbs} (samples per step on the legacy path) must be a multiple of "
                              f"dp_size={dp_size}")
    local = gbs // dp_size
    n = len(local_lengths)
    num_steps, tail = divmod(n, local)
    if num_steps == 0 or tail:
        raise LegacyPlanError(
            f"this rank has {n} samples, not a positive multiple of global_batch_size/dp_size = {local}; the legacy "
            f"path would drop {tail if num_steps else n} samples. Send a multiple of {local} samples per rank (or use "
            f"--dp-schedule rollout)")
    if not use_dynamic_batch_size:
        if local % micro_batch_size:
            raise LegacyPlanError(f"global_batch_size/dp_size = {local} is not a multiple of "
                                  f"micro_batch_size={micro_batch_size}; make global_batch_size a multiple of "
                                  f"{dp_size * micro_batch_size}")
        counts = [local // micro_batch_size] * num_steps
        if vpp_size > 1 and counts[0] % group:
            raise LegacyPlanError(f"global_batch_size={gbs}: {counts[0]} micro-batches per rank and step is not a "
                                  f"multiple of microbatch_group_size_per_vp_stage={group} (Megatron's interleaved "
                                  f"schedule); make global_batch_size a multiple of "
                                  f"{dp_size * micro_batch_size * group}")
        return [list(range(i, i + micro_batch_size)) for i in range(0, n, micro_batch_size)], counts
    found = reduce_max(legacy_step_counts(local_lengths, local, cap))
    counts = round_for_vpp(found, vpp_size, group)
    for s, c in enumerate(counts):
        if c % group:
            raise LegacyPlanError(
                f"step {s}: {found[s]} micro-batches, below one microbatch_group_size_per_vp_stage={group}; upstream "
                f"rounds that to {c}, which Megatron's interleaved schedule cannot run. Raise --global-batch-size, "
                f"lower --max-tokens-per-gpu, or use --dp-schedule rollout")
    return legacy_micro_batches(local_lengths, local, counts), counts


def legacy_schedule(
    total_lengths: Sequence[int],
    *,
    dp_size: int,
    global_batch_size: int,
    max_tokens_per_gpu: int,
    cp_size: int = 1,
    vpp_size: int = 1,
    microbatch_group_size_per_vp_stage: int = 1,
    balance_data: bool = False,
) -> BaselineSchedule:
    """Baseline (a): legacy split on the rollout side, then ``get_data_iterator`` on every rank.

    ``timings`` records the split and, per rank, the count and KK phases: in production the ranks run in parallel,
    so the scheme's wall time is ``split + max(count) + max(kk)`` (the all-reduce is a barrier between the two).
    """
    lengths = [int(x) for x in total_lengths]
    t0 = time.perf_counter()
    rank_samples = split_train_data_by_dp(lengths, dp_size, balance_data)
    t_split = time.perf_counter() - t0

    cap = max_tokens_per_gpu * cp_size
    num_local_gbs = global_batch_size // dp_size
    local_lengths = [[lengths[i] for i in part] for part in rank_samples]
    t_count, per_rank_counts = [], []
    for r in range(dp_size):
        t0 = time.perf_counter()
        per_rank_counts.append(legacy_step_counts(local_lengths[r], num_local_gbs, cap))
        t_count.append(time.perf_counter() - t0)
    # dist.all_reduce(num_microbatches, op=MAX) over the DP group; ranks with unequal step counts would hang there
    num_steps = {len(c) for c in per_rank_counts}
    if len(num_steps) != 1:
        raise ValueError(f"ranks disagree on the number of steps: {sorted(num_steps)}")
    counts = [max(c[s] for c in per_rank_counts) for s in range(num_steps.pop())]
    counts = round_for_vpp(counts, vpp_size, microbatch_group_size_per_vp_stage)

    partitions: list[list[int]] = []
    micro_batch_indices: list[list[list[int]]] = []
    t_kk = []
    for r in range(dp_size):
        t0 = time.perf_counter()
        local_mbs = legacy_micro_batches(local_lengths[r], num_local_gbs, counts)
        t_kk.append(time.perf_counter() - t0)
        # re-express in the DPSchedule shape: the partition in micro-batch order, micro-batches tiling it
        part, mbis = [], []
        for mb in local_mbs:
            mbis.append(list(range(len(part), len(part) + len(mb))))
            part.extend(rank_samples[r][i] for i in mb)
        partitions.append(part)
        micro_batch_indices.append(mbis)
    timings = {"split": t_split, "count": t_count, "kk": t_kk,
               "wall": t_split + max(t_count) + max(t_kk), "cpu": t_split + sum(t_count) + sum(t_kk)}
    return BaselineSchedule(partitions, micro_batch_indices, counts, timings)


def reference_args(model_dims: dict, *, max_tokens_per_gpu: int, balance_data: bool, balance_by_flops: bool):
    """An ``args`` namespace with the slime flags and Megatron model dims the reference reads."""
    return SimpleNamespace(
        use_dynamic_batch_size=True, max_tokens_per_gpu=max_tokens_per_gpu, micro_batch_size=1,
        balance_data=balance_data, balance_by_flops=balance_by_flops, **model_dims,
    )
