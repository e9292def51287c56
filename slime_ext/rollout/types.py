"""``Sample``: what a rollout function returns, one per training sequence (slime's ``Sample``, reduced to what we train).

A *rollout* is one episode for one prompt; it may emit several samples (multi-turn with context compaction, or
a trajectory cut into segments). All samples of one rollout share ``index`` (the rollout id), so the scheduler
keeps them in one training step. ``group_index`` is the prompt: the ``n_samples_per_prompt`` rollouts of one
prompt form the group that advantages are computed over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    #: rollout id; every sample of one rollout carries the same one (upstream ``Sample.index``)
    index: int
    #: prompt group (``n_samples_per_prompt`` rollouts of one prompt share it)
    group_index: int
    #: prompt + response token ids
    tokens: list[int]
    #: the last ``response_length`` tokens are the response (at least one prompt token precedes them)
    response_length: int
    #: one 0/1 per response token (0: not trained on, e.g. tool output inside a multi-turn response);
    #: ``None`` means all ones
    loss_mask: list[int] | None
    reward: float
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def total_length(self) -> int:
        return len(self.tokens)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length
