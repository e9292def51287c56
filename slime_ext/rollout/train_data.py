"""Samples -> train data: one :class:`slime_ext.schedule.SampleBatch` (slime's ``_convert_samples_to_train_data``).

A sample's position in the batch is its global sample id (what ``DPSchedule.partitions`` refer to). Loss masks
default to all ones; ``advantages`` are the reward minus the mean reward of the sample's prompt group, taken over
*rollouts* (a rollout that emitted three samples counts once), GRPO-style without std normalisation.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from slime_ext.schedule import SampleBatch

from .types import Sample


class SampleError(ValueError):
    """A rollout function returned something that cannot be trained on; the message names the sample and the fix."""


def flatten_samples(output: Any) -> list[Sample]:
    """A rollout function's output (``list[Sample]`` or ``list[list[Sample]]``, prompt groups) as one flat list."""
    if not isinstance(output, (list, tuple)):
        raise SampleError(f"the rollout function returned {type(output).__name__}; return a list of Sample "
                               f"(or a list of prompt groups, each a list of Sample)")
    flat: list[Sample] = []
    for item in output:
        if isinstance(item, (list, tuple)):
            flat.extend(item)
        else:
            flat.append(item)
    for k, s in enumerate(flat):
        if not isinstance(s, Sample):
            raise SampleError(f"rollout output item {k} is a {type(s).__name__}, not a "
                                   f"slime_ext.rollout.types.Sample")
    if not flat:
        raise SampleError("the rollout function returned no samples; check rollout_batch_size and the function")
    return flat


def _check_sample(k: int, s: Sample, vocab_size: int | None, seq_length: int | None) -> list[int]:
    where = f"sample {k} (rollout {s.index})"
    if isinstance(s.index, bool) or not isinstance(s.index, int):
        raise SampleError(f"sample {k}: index={s.index!r} is not an integer; give every sample its rollout id "
                          f"(Sample.index, shared by the samples of one rollout)")
    n = len(s.tokens)
    if not 0 < s.response_length < n:
        raise SampleError(f"{where}: response_length={s.response_length} must be in [1, len(tokens)-1="
                               f"{n - 1}]; at least one prompt token must precede the response")
    if seq_length is not None and n > seq_length:
        raise SampleError(f"{where}: {n} tokens exceed seq_length={seq_length}; truncate the sample in the "
                               f"rollout function or raise seq_length")
    if vocab_size is not None and (min(s.tokens) < 0 or max(s.tokens) >= vocab_size):
        raise SampleError(f"{where}: token ids span [{min(s.tokens)}, {max(s.tokens)}], outside "
                               f"[0, vocab_size={vocab_size})")
    mask = [1] * s.response_length if s.loss_mask is None else [int(m) for m in s.loss_mask]
    if len(mask) != s.response_length:
        raise SampleError(f"{where}: loss_mask has {len(mask)} entries but response_length="
                               f"{s.response_length}; give one 0/1 per response token")
    if any(m not in (0, 1) for m in mask):
        raise SampleError(f"{where}: loss_mask holds values other than 0 and 1")
    return mask


def group_advantages(samples: Sequence[Sample]) -> list[float]:
    """Per sample: its rollout's reward minus the mean over the rollouts of its prompt group."""
    rollout_reward: dict[int, float] = {}
    rollout_group: dict[int, int] = {}
    for k, s in enumerate(samples):
        if s.index in rollout_reward and rollout_reward[s.index] != s.reward:
            raise SampleError(f"sample {k}: rollout {s.index} has samples with different rewards "
                                   f"({rollout_reward[s.index]} and {s.reward}); give every sample of a rollout "
                                   f"the rollout's reward")
        if s.index in rollout_group and rollout_group[s.index] != s.group_index:
            raise SampleError(f"sample {k}: rollout {s.index} has samples in groups {rollout_group[s.index]} "
                                   f"and {s.group_index}; a rollout belongs to one prompt group")
        rollout_reward[s.index] = float(s.reward)
        rollout_group[s.index] = s.group_index
    members: dict[int, list[float]] = defaultdict(list)
    for rid, g in rollout_group.items():
        members[g].append(rollout_reward[rid])
    mean = {g: sum(r) / len(r) for g, r in members.items()}
    return [float(s.reward) - mean[s.group_index] for s in samples]


def samples_to_train_data(samples: Sequence[Sample], *, vocab_size: int | None = None,
                          seq_length: int | None = None) -> SampleBatch:
    """Validate ``samples`` and lay them out as one :class:`SampleBatch`, in rollout order."""
    masks = [_check_sample(k, s, vocab_size, seq_length) for k, s in enumerate(samples)]
    return SampleBatch(
        tokens=[list(s.tokens) for s in samples],
        total_lengths=[len(s.tokens) for s in samples],
        response_lengths=[int(s.response_length) for s in samples],
        loss_masks=masks,
        rewards=[float(s.reward) for s in samples],
        advantages=group_advantages(samples),
        rollout_ids=[int(s.index) for s in samples],
    )
