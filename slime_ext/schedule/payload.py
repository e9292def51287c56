"""``RankPayload``: what one DP rank receives for one rollout, its samples and its slice of the schedule."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Sequence

from .errors import ScheduleError


def _fail(field: str, value, fix: str):
    """``field=value: fix``; a value written ``<...>`` is a summary (e.g. ``<3 entries>``), shown as is."""
    shown = value if isinstance(value, str) and value.startswith("<") else repr(value)
    raise ScheduleError(f"{field}={shown}: {fix}")


@dataclass(frozen=True)
class SampleBatch:
    """Per-sample fields, one entry per sample, in the order the rank trains them."""

    tokens: list[list[int]]
    total_lengths: list[int]  # len(tokens[i])
    response_lengths: list[int]  # the last response_lengths[i] tokens are the response
    loss_masks: list[list[int]]  # one 0/1 per response token
    rewards: list[float]
    advantages: list[float]
    rollout_ids: list[int]  # the rollout each sample came from (what steps group by)

    #: the per-sample field names, in declaration order
    KEYS: ClassVar[tuple[str, ...]]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for key in self.KEYS:
            values = getattr(self, key)
            if not isinstance(values, list) or len(values) != n:
                _fail(f"SampleBatch.{key}", type(values).__name__ if not isinstance(values, list) else
                      f"<{len(values)} entries>", f"give a list with one entry per sample ({n}, as tokens)")
        for i in range(n):
            total, resp = self.total_lengths[i], self.response_lengths[i]
            if len(self.tokens[i]) != total:
                _fail(f"total_lengths[{i}]", total, f"must equal len(tokens[{i}])={len(self.tokens[i])}")
            if not 0 < resp < total:
                _fail(f"response_lengths[{i}]", resp, f"must be in [1, total_length-1={total - 1}] (at least one "
                                                      f"prompt token predicts the first response token)")
            if len(self.loss_masks[i]) != resp:
                _fail(f"loss_masks[{i}]", f"<{len(self.loss_masks[i])} entries>",
                      f"give one 0/1 per response token ({resp})")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def loss_tokens(self) -> list[int]:
        """Loss-mask tokens per sample."""
        return [sum(m) for m in self.loss_masks]

    def take(self, indices: Sequence[int]) -> "SampleBatch":
        """The samples at ``indices``, in that order."""
        return SampleBatch(**{k: [getattr(self, k)[i] for i in indices] for k in self.KEYS})


SampleBatch.KEYS = tuple(f.name for f in fields(SampleBatch))


@dataclass(frozen=True)
class RankPayload:
    """One DP rank's share of one rollout; the schedule slice is ``None`` on the legacy path (the trainer plans)."""

    rollout_id: int
    dp_rank: int
    dp_size: int
    partition: list[int]  # global sample ids, in the order of ``samples``
    samples: SampleBatch
    micro_batch_indices: list[list[int]] | None = None  # local indices per micro-batch, tiling range(len(samples))
    num_microbatches: list[int] | None = None  # micro-batches per step, the same on every rank
    samples_per_step: list[int] | None = None  # samples each step trains on, over all ranks (LR increment)
    rollouts_per_step: list[int] | None = None  # rollouts each step trains on, over all ranks
    loss_tokens_per_step: list[int] | None = None  # loss-mask tokens per step over all ranks (loss normaliser)
    global_batch_size: int | None = None  # legacy path only: samples per step (upstream's meaning)

    def __post_init__(self) -> None:
        if not isinstance(self.samples, SampleBatch):
            _fail("samples", type(self.samples).__name__, "must be a SampleBatch")
        n = len(self.samples)
        if not 0 <= self.dp_rank < self.dp_size:
            _fail("dp_rank", self.dp_rank, f"must be in [0, dp_size={self.dp_size})")
        if len(self.partition) != n:
            _fail("partition", f"<{len(self.partition)} ids>", f"give one global id per sample ({n})")
        if not self.planned:
            if self.global_batch_size is None or self.num_microbatches is not None:
                _fail("global_batch_size", self.global_batch_size, "the legacy path (no micro_batch_indices) needs "
                      "samples per step and no other schedule field")
            return
        nmb, mbi = self.num_microbatches, self.micro_batch_indices
        if not nmb or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in nmb):
            _fail("num_microbatches", nmb, "must be a non-empty list of positive integers")
        if sum(nmb) != len(mbi):
            _fail("num_microbatches", nmb, f"must sum to the {len(mbi)} micro-batches of micro_batch_indices; send "
                                           f"the rank's schedule slice unchanged")
        if any(len(mb) == 0 for mb in mbi) or [i for mb in mbi for i in mb] != list(range(n)):
            _fail("micro_batch_indices", f"<{len(mbi)} micro-batches>",
                  f"must tile range({n}) in order with no empty micro-batch (samples in partition order)")
        for key in ("samples_per_step", "rollouts_per_step", "loss_tokens_per_step"):
            values = getattr(self, key)
            if (values is None and key != "loss_tokens_per_step") or (values is not None and len(values) != len(nmb)):
                _fail(key, values, f"give one entry per step ({len(nmb)})")

    @property
    def planned(self) -> bool:
        """Whether the rollout side sent a schedule (rollout path) or left planning to the trainer (legacy)."""
        return self.micro_batch_indices is not None

    def column(self, key: str) -> list:
        """A per-sample column; ``sample_indices`` is the global id of each sample (``partition``)."""
        return self.partition if key == "sample_indices" else getattr(self.samples, key)
