"""A deterministic stand-in for Megatron-RL's inference engine: GRPO groups of token rollouts from a seed.

What Megatron-RL gets from its inference engine is one rollout collection per call of
``megatron.rl.rl_utils.get_environment_rollouts``: ``grpo_prompts_per_step`` groups of ``grpo_group_size`` token
rollouts (prompt + generated tokens, a generation mask, the sampler's log-probs, a reward). This module makes such a
collection without a model, from ``(seed, collection)`` alone, in Megatron-RL's own rollout types for the version
that is imported (:func:`to_megatron`), so everything after the engine -- ``compute_group_stats``,
``prepare_trajectories``, packing, the log-prob passes, the loss -- is Megatron-RL's real code.

The samples (:func:`make_collection`):

* lengths are long-tailed, as RL rollouts are: a short prompt (4-15 tokens) and a response whose length is drawn from
  a log-normal distribution, so most rows are short and a few fill most of ``seq_length``; every row fits in one bin
  (prompt + response <= ``seq_length``) and every response ends in the end-of-document token, exactly once;
* every sample is identifiable from its tokens alone: its first two tokens encode its index in the collection
  (:func:`sample_id_of`), so a harness can tell which samples a packed micro-batch holds by reading the token row
  the model receives, whatever packing produced it;
* tokens are drawn from ``[FIRST_TOKEN, min(pad, eod))``, never the pad or end-of-document ids;
* rewards are distinct floats (no group has zero reward variance, so every GRPO advantage is non-zero) and the
  sampler log-probs are negative floats, one per generated token.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np

#: the smallest token id a sample uses; samples draw from [FIRST_TOKEN, min(pad, eod))
FIRST_TOKEN = 1
#: how many ids the two-token sample tag spans per position (ids FIRST_TOKEN .. FIRST_TOKEN + TAG_BASE - 1)
TAG_BASE = 100
PROMPT_LENGTHS = (4, 16)  # [low, high)
ENV_ID = "slime-ext-synthetic"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One rollout of a collection. ``index`` is its position in the collection, group-major (``group *
    group_size + member``), which is the order Megatron-RL flattens a collection in."""

    index: int
    group: int
    tokens: tuple[int, ...]
    prompt_length: int
    reward: float
    logprobs: tuple[float, ...]  # one per generated token

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def generation_mask(self) -> tuple[bool, ...]:
        return (False,) * self.prompt_length + (True,) * (self.length - self.prompt_length)


def sample_id_of(tokens) -> int:
    """The collection index a sample's first two tokens encode (see :func:`make_collection`)."""
    hi, lo = int(tokens[0]) - FIRST_TOKEN, int(tokens[1]) - FIRST_TOKEN
    if not (0 <= hi < TAG_BASE and 0 <= lo < TAG_BASE):
        raise ValueError(f"tokens {list(tokens[:2])} are not a synthetic sample's tag")
    return hi * TAG_BASE + lo


def make_collection(seed: int, collection: int, n_prompts: int, group_size: int, seq_length: int,
                    eod: int, pad: int) -> list[list[Sample]]:
    """``n_prompts`` groups of ``group_size`` samples, a pure function of its arguments."""
    top = min(eod, pad)  # tokens are drawn below the special ids
    n = n_prompts * group_size
    if n > TAG_BASE * TAG_BASE:
        raise ValueError(f"{n} samples per collection: the two-token tag holds at most {TAG_BASE ** 2}")
    if top <= FIRST_TOKEN + TAG_BASE:
        raise ValueError(f"eod={eod}, pad={pad}: the vocabulary must hold the tag ids {FIRST_TOKEN}.."
                         f"{FIRST_TOKEN + TAG_BASE - 1} below both")
    if seq_length < PROMPT_LENGTHS[1] + 2:
        raise ValueError(f"seq_length={seq_length} is too short for prompts of up to {PROMPT_LENGTHS[1] - 1} tokens")
    rng = np.random.default_rng([int(seed), int(collection)])
    groups = []
    for g in range(n_prompts):
        prompt_length = int(rng.integers(*PROMPT_LENGTHS))
        prompt = rng.integers(FIRST_TOKEN, top, size=prompt_length)
        members = []
        for m in range(group_size):
            index = g * group_size + m
            room = seq_length - prompt_length  # response tokens, eod included
            response_length = int(min(room, max(2, round(rng.lognormal(mean=np.log(room / 6), sigma=0.9)))))
            response = rng.integers(FIRST_TOKEN, top, size=response_length)
            response[-1] = eod
            tokens = np.concatenate([prompt, response])
            tokens[0], tokens[1] = FIRST_TOKEN + index // TAG_BASE, FIRST_TOKEN + index % TAG_BASE
            members.append(Sample(
                index=index, group=g, tokens=tuple(int(t) for t in tokens), prompt_length=prompt_length,
                reward=float(rng.uniform(0.0, 1.0)),
                logprobs=tuple(float(x) for x in -rng.uniform(0.05, 4.0, size=response_length)),
            ))
        groups.append(members)
    return groups


# ---------------------------------------------------------------------------------------------------- Megatron-RL types
def _rollout_types():
    """``(TokenRollout, RolloutGroup or None)`` of the imported Megatron-RL (they moved between versions)."""
    try:  # HEAD (core 0.20)
        from megatron.rl.types.rollout import RolloutGroup, TokenRollout
        return TokenRollout, RolloutGroup
    except ImportError:
        pass
    from megatron.rl.agent import api
    return api.TokenRollout, getattr(api, "RolloutGroup", None)


def returns_request_ledger() -> bool:
    """Whether the imported ``get_environment_rollouts`` returns ``(rollouts, request_ledger)`` (HEAD) rather than
    the rollouts alone (core_v0.16.1 to core_v0.19.0): read from ``compute_group_stats``, which takes the ledger."""
    from megatron.rl import rl_utils

    return "request_ledger" in inspect.signature(rl_utils.compute_group_stats).parameters


def to_megatron(groups: list[list[Sample]], epoch: int):
    """The collection as the imported Megatron-RL's ``get_environment_rollouts`` returns it.

    Per version: HEAD wants ``RolloutGroup``s of ``TokenRollout``s with ``completion_ids`` and a request ledger of
    ``FinishedRequestRecord``s (policy/KV-cache epochs per completion); core_v0.19.0 keeps those epochs on the
    ``TokenRollout`` itself; core_v0.16.1 takes plain lists of ``TokenRollout``s. ``epoch`` is the policy version
    that "generated" the collection (the training iteration at collection time).
    """
    TokenRollout, RolloutGroup = _rollout_types()
    fields = set(TokenRollout.model_fields)
    ledger = {}
    out = []
    for members in groups:
        rollouts = []
        for s in members:
            kwargs = dict(trajectory=[list(s.tokens)], reward=s.reward, generation_mask=[list(s.generation_mask)],
                          logprobs=[list(s.logprobs)], env_id=ENV_ID, problem_id=f"prompt-{s.group}")
            if "completion_ids" in fields:  # HEAD: per-turn metadata lives in the request ledger
                cid = f"synthetic-{epoch}-{s.index}"
                kwargs["completion_ids"] = [cid]
                ledger[cid] = _ledger_record(epoch)
            if "policy_epoch" in fields:  # core_v0.19.0: on the rollout, per turn [(token offset, epoch)]
                kwargs.update(policy_epoch=[[(0, epoch)]], kv_cache_epoch=[[(0, epoch)]], num_evictions=[0])
            rollouts.append(TokenRollout(**kwargs))
        out.append(RolloutGroup(rollouts=rollouts) if RolloutGroup is not None else rollouts)
    return (out, ledger) if returns_request_ledger() else out


def _ledger_record(epoch: int):
    from megatron.core.inference.inference_request import FinishedRequestRecord

    return FinishedRequestRecord(policy_epoch=[(0, epoch)], kv_cache_epoch=[(0, epoch)], num_evictions=0)
