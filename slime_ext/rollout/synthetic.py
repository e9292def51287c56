"""The default rollout function: a seeded synthetic generator shaped like RL rollouts (no inference engine).

``generate_rollout(args, rollout_id)`` returns ``rollout_batch_size`` prompt groups of ``n_samples_per_prompt``
rollouts each, as slime's rollout functions do (``list[list[Sample]]``, one inner list per prompt). What makes
the scheduling problem real is kept:

* **long-tailed lengths**: prompt lengths are uniform in ``[synthetic_prompt_length_min, ..._max]``, response
  lengths lognormal around ``synthetic_response_length_median`` with ``synthetic_response_length_sigma``, capped
  so that every sample fits ``seq_length`` (a few responses hit the cap, most are short);
* **multi-sample rollouts**: with probability ``synthetic_multi_sample_prob`` a rollout emits 2 to
  ``synthetic_max_samples_per_rollout`` samples (multi-turn with context compaction: each segment re-states a
  prefix of the prompt plus a summary), all with the rollout's id and reward;
* **loss masks with holes**: with probability ``synthetic_masked_span_prob`` a response has a span of zeros inside
  it (tool output the policy did not write); every response keeps at least its first token trainable;
* **rewards**: the share of response tokens in the lower half of the vocabulary plus Gaussian noise, so rewards
  depend on the tokens and differ inside a group.

Token ids are in ``[0, vocab_size)``. Everything is drawn from ``numpy.random.default_rng([rollout_seed,
rollout_id])``: the same seed and rollout id give the same samples in any process. Rollout ids are unique over
the run: rollout ``k`` of iteration ``rollout_id`` has ``index = rollout_id * rollouts_per_iteration + k``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .types import Sample

#: the generator's keys and defaults (the run config accepts exactly these; see :mod:`slime_ext.rollout.config`)
SYNTHETIC_DEFAULTS: dict[str, Any] = {
    "synthetic_prompt_length_min": 4,
    "synthetic_prompt_length_max": 24,
    "synthetic_response_length_median": 20,
    "synthetic_response_length_sigma": 0.9,
    "synthetic_multi_sample_prob": 0.25,
    "synthetic_max_samples_per_rollout": 3,
    "synthetic_masked_span_prob": 0.3,
}


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    if value is None:
        value = SYNTHETIC_DEFAULTS.get(name, default)
    return value


def synthetic_bounds(args: Any) -> dict[str, int]:
    """Shortest / longest sample and most samples per rollout the generator can emit for ``args``."""
    seq_length = int(args.seq_length)
    multi = float(_arg(args, "synthetic_multi_sample_prob")) > 0
    return {
        "min_total_length": int(_arg(args, "synthetic_prompt_length_min")) + 1,
        "max_total_length": seq_length,
        "min_samples_per_rollout": 1,
        "max_samples_per_rollout": int(_arg(args, "synthetic_max_samples_per_rollout")) if multi else 1,
    }


def _response_length(rng: np.random.Generator, median: float, sigma: float, room: int) -> int:
    length = int(round(rng.lognormal(math.log(median), sigma)))
    return min(max(1, length), room)


def _loss_mask(rng: np.random.Generator, length: int, span_prob: float) -> list[int]:
    mask = np.ones(length, dtype=np.int64)
    if length >= 3 and rng.random() < span_prob:
        start = int(rng.integers(1, length - 1))  # the first response token stays trainable
        stop = int(rng.integers(start + 1, length))  # and so does the last
        mask[start:stop] = 0
    return mask.tolist()


def generate_rollout(args: Any, rollout_id: int, data_source: Any = None, evaluation: bool = False
                     ) -> list[list[Sample]]:
    """``rollout_batch_size`` groups of ``n_samples_per_prompt`` rollouts (slime's rollout function signature).

    ``data_source`` and ``evaluation`` are accepted for signature compatibility; the generator has no dataset.
    """
    seq_length, vocab = int(args.seq_length), int(args.vocab_size)
    num_prompts, per_prompt = int(args.rollout_batch_size), int(args.n_samples_per_prompt)
    p_min, p_max = int(_arg(args, "synthetic_prompt_length_min")), int(_arg(args, "synthetic_prompt_length_max"))
    median = float(_arg(args, "synthetic_response_length_median"))
    sigma = float(_arg(args, "synthetic_response_length_sigma"))
    multi_prob = float(_arg(args, "synthetic_multi_sample_prob"))
    max_segments = int(_arg(args, "synthetic_max_samples_per_rollout"))
    span_prob = float(_arg(args, "synthetic_masked_span_prob"))
    if not 1 <= p_min <= p_max < seq_length:
        raise ValueError(f"synthetic prompt lengths [{p_min}, {p_max}] must satisfy 1 <= min <= max < "
                         f"seq_length={seq_length}; lower synthetic_prompt_length_max")
    rng = np.random.default_rng([int(getattr(args, "rollout_seed", 0) or 0), int(rollout_id)])
    rollouts_per_iteration = num_prompts * per_prompt

    groups: list[list[Sample]] = []
    for p in range(num_prompts):
        prompt = rng.integers(0, vocab, int(rng.integers(p_min, p_max + 1))).tolist()
        group: list[Sample] = []
        for j in range(per_prompt):
            index = rollout_id * rollouts_per_iteration + p * per_prompt + j
            segments = 1
            if max_segments > 1 and rng.random() < multi_prob:
                segments = int(rng.integers(2, max_segments + 1))
            pieces = []
            for seg in range(segments):
                if seg == 0:
                    context = prompt
                else:  # compaction: a prefix of the prompt plus a summary of what came before
                    keep = int(rng.integers(1, len(prompt) + 1))
                    summary = rng.integers(0, vocab, int(rng.integers(1, p_max + 1))).tolist()
                    context = (prompt[:keep] + summary)[: seq_length - 1]
                room = seq_length - len(context)
                resp_len = _response_length(rng, median, sigma, room)
                response = rng.integers(0, vocab, resp_len).tolist()
                pieces.append((context, response, _loss_mask(rng, resp_len, span_prob)))
            trained = [t for _, resp, mask in pieces for t, m in zip(resp, mask) if m]
            low_share = float(np.mean(np.asarray(trained) < vocab // 2)) if trained else 0.0
            reward = low_share + float(rng.normal(0.0, 0.1))
            for seg, (context, response, mask) in enumerate(pieces):
                group.append(Sample(index=index, group_index=rollout_id * num_prompts + p,
                                    tokens=context + response, response_length=len(response), loss_mask=mask,
                                    reward=reward, metadata={"segment": seg, "segments": segments}))
        groups.append(group)
    return groups
