"""The two baselines of issue 2, re-implemented in plain Python, step by step as upstream slime writes them.

Upstream code (THUDM/slime) was read as reference only; this is our own code for the same algorithms, with the
same loops, data structures and tie-breaking, deliberately not vectorised: the point is to measure what upstream
costs. Where upstream has a quirk we keep it and say so.

* ``seqlen_balancing``  -- ``karmarkar_karp`` (sets/states in a ``heapq``, as in ``slime/utils/seqlen_balancing.py``,
  itself from verl), ``get_seqlen_balanced_partitions``, the quadratic ``first_fit_pack``,
  ``expand_bins_by_splitting``.
* ``flops_utils``       -- ``calculate_fwd_flops`` for a dense model (``slime/utils/flops_utils.py``); it keeps
  upstream's K/V projection term ``2 L h (heads // groups) kv``.
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


@dataclass
class BaselineSchedule:
    partitions: list[list[int]]
    micro_batch_indices: list[list[list[int]]]
    num_microbatches: list[int]
    #: legacy only: seconds of each phase (the rollout-side split, then per rank: count, then KK)
    timings: dict[str, Any] = field(default_factory=dict)


# ================================================================================================ seqlen_balancing
class _KKSet:
    """One group of a partial KK solution: its sum and its ``(index, value)`` items."""

    def __init__(self) -> None:
        self.sum = 0
        self.items: list[tuple[int, Any]] = []

    def add(self, idx: int, val) -> None:
        self.items.append((idx, val))
        self.sum += val

    def merge(self, other: "_KKSet") -> None:
        for idx, val in other.items:
            self.items.append((idx, val))
            self.sum += val

    def __lt__(self, other: "_KKSet") -> bool:  # by sum, then item count, then the items themselves
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _KKState:
    """A partial KK solution: ``k`` sets kept in decreasing order."""

    def __init__(self, items: list[tuple[int, Any]], k: int) -> None:
        self.k = k
        self.sets = [_KKSet() for _ in range(k)]
        assert len(items) in (1, k), f"{len(items)} not in [1, {k}]"
        for i, (idx, val) in enumerate(items):
            self.sets[i].add(idx, val)
        self.sets = sorted(self.sets, reverse=True)

    def get_partitions(self) -> list[list[int]]:
        return [[idx for idx, _ in s.items] for s in self.sets]

    def merge(self, other: "_KKState") -> None:
        for i in range(self.k):  # heaviest of one with the lightest of the other
            self.sets[i].merge(other.sets[self.k - 1 - i])
        self.sets = sorted(self.sets, reverse=True)

    @property
    def spread(self):
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: "_KKState") -> bool:  # min-heap pops the largest spread first, then the largest set
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def karmarkar_karp(seqlen_list: Sequence, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Largest differencing method over ``k_partitions`` groups (equal item counts with ``equal_size``)."""
    sorted_seqlen_list = sorted((seqlen, i) for i, seqlen in enumerate(seqlen_list))
    states_pq: list[_KKState] = []
    if equal_size:
        assert len(seqlen_list) % k_partitions == 0, f"{len(seqlen_list)} % {k_partitions} != 0"
        for offset in range(0, len(sorted_seqlen_list), k_partitions):
            items = []
            for i in range(k_partitions):
                seqlen, idx = sorted_seqlen_list[offset + i]
                items.append((idx, seqlen))
            heapq.heappush(states_pq, _KKState(items, k_partitions))
    else:
        for seqlen, idx in sorted_seqlen_list:
            heapq.heappush(states_pq, _KKState([(idx, seqlen)], k_partitions))
    while len(states_pq) > 1:
        state0 = heapq.heappop(states_pq)
        state1 = heapq.heappop(states_pq)
        state0.merge(state1)
        heapq.heappush(states_pq, state0)
    partitions = states_pq[0].get_partitions()
    if equal_size:
        for partition in partitions:
            assert len(partition) * k_partitions == len(seqlen_list)
    return partitions


def get_seqlen_balanced_partitions(seqlen_list: Sequence, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """KK, then checks (k groups, none empty, every index once) and each group sorted by index."""
    assert len(seqlen_list) >= k_partitions, f"number of items:[{len(seqlen_list)}] < k_partitions:[{k_partitions}]"
    partitions = karmarkar_karp(seqlen_list, k_partitions, equal_size)
    assert len(partitions) == k_partitions
    seen: set[int] = set()
    out: list[list[int]] = [None] * k_partitions  # type: ignore[list-item]
    for i, partition in enumerate(partitions):
        assert len(partition) > 0, f"the {i}-th partition is empty"
        seen.update(partition)
        out[i] = sorted(partition)
    assert seen == set(range(len(seqlen_list)))
    return out


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
def calculate_fwd_flops(seqlens: Sequence[int], args: Any) -> float:
    """Forward FLOPs of ``seqlens`` for a dense, non-MLA model (upstream's per-term formulas, summed per sample).

    Per layer: Q projection ``2 L h heads kv``, K/V projection ``2 L h (heads // groups) kv`` (upstream's term, see
    the report: a K+V projection is ``2 L h 2 groups kv``), causal attention ``2 heads L^2 kv / 2 + heads L^2 kv``,
    output ``2 L h^2``, gated MLP ``6 L h ffn``; plus the LM head ``2 L h vocab``.
    """
    h = args.hidden_size
    heads = args.num_attention_heads
    groups = args.num_query_groups
    kv = args.kv_channels
    ffn = args.ffn_hidden_size
    total = 0
    for seqlen in seqlens:
        qkv = 2 * seqlen * h * heads * kv + 2 * seqlen * h * (heads // groups) * kv
        attention = 2 * heads * seqlen * seqlen * kv / 2 + heads * seqlen * seqlen * kv
        output = 2 * seqlen * h * h
        mlp = 2 * seqlen * h * ffn * 3
        total += (qkv + attention + output + mlp) * args.num_layers
        total += 2 * seqlen * h * args.vocab_size
    return total


def _calculate_workloads(step_lengths: Sequence[int], args: Any) -> list[float]:
    return [calculate_fwd_flops([sl], args) for sl in step_lengths]


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
def split_train_data_by_dp(total_lengths: list[int], dp_size: int, balance_data: bool) -> list[list[int]]:
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


def _legacy_local_counts(local_lengths: list[int], num_local_gbs: int, cap: int) -> list[int]:
    num_steps = len(local_lengths) // num_local_gbs
    return [get_minimum_num_micro_batch_size(local_lengths[i * num_local_gbs:(i + 1) * num_local_gbs], cap)
            for i in range(num_steps)]


def _legacy_local_micro_batches(local_lengths: list[int], num_local_gbs: int, counts: list[int]) -> list[list[int]]:
    """KK of each local step into ``counts[s]`` micro-batches, no cap; local indices into the rank's samples."""
    micro_batch_indices: list[list[int]] = []
    for i, num_mbs in enumerate(counts):
        start, end = i * num_local_gbs, (i + 1) * num_local_gbs
        parts = get_seqlen_balanced_partitions(local_lengths[start:end], num_mbs, equal_size=False)
        for part in parts:
            for j in range(len(part)):
                part[j] += start
        micro_batch_indices.extend(parts)
    assert len(set(sum(micro_batch_indices, []))) == len(local_lengths)
    return micro_batch_indices


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
        per_rank_counts.append(_legacy_local_counts(local_lengths[r], num_local_gbs, cap))
        t_count.append(time.perf_counter() - t0)
    # dist.all_reduce(num_microbatches, op=MAX) over the DP group; ranks with unequal step counts would hang there
    num_steps = {len(c) for c in per_rank_counts}
    assert len(num_steps) == 1, f"ranks disagree on the number of steps: {sorted(num_steps)}"
    counts = [max(c[s] for c in per_rank_counts) for s in range(num_steps.pop())]
    if vpp_size > 1:  # upstream rounds DOWN to a multiple of the group (clamped at 1)
        g = microbatch_group_size_per_vp_stage
        counts = [max(1, c // g * g) for c in counts]

    partitions: list[list[int]] = []
    micro_batch_indices: list[list[list[int]]] = []
    t_kk = []
    for r in range(dp_size):
        t0 = time.perf_counter()
        local_mbs = _legacy_local_micro_batches(local_lengths[r], num_local_gbs, counts)
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
