"""What replaces NeMo-RL's code behind the switch (the patches: :mod:`slime_ext.patches.nemo_rl_host`).

* ``Policy.__init__``: reads and checks the policy config (:func:`.settings.layout_from_config`; a setting slime-ext
  cannot honour is refused before any worker starts), and builds the policy with dynamic batching run as sequence
  packing (:func:`.settings.run_as_packing`; this lifts NeMo-RL's one-pipeline-stage assert). Under pipeline
  parallelism, unless the ``pad_to_longest`` opt-out is set, it passes slime-ext's worker class
  (:mod:`.worker`) as ``worker_extension_cls_fqn`` (refusing a class of the caller's), and a worker environment
  without slime-ext is named as such (:func:`.worker.missing_slime_ext_named`). The policy remembers its layout.
* ``Policy._shard_for_train`` / ``Policy._shard_for_logprob``: NeMo-RL's own, run with the pass and the policy's
  layout set in a context variable (training, or forward-only for the log-prob passes).
* ``BatchedDataDict.shard_by_batch_size``: inside those two, a call with ``sequence_packing_args`` is planned by
  slime-ext (:func:`.plan.plan_shards`, under the cap NeMo-RL passes: ``train_mb_tokens`` or
  ``logprob_mb_tokens``; under pipeline parallelism with the padding NeMo-RL's worker adds priced in) and returned
  as NeMo-RL returns it: ``(shards, sorted_indices)``, each shard carrying
  ``micro_batch_indices``, ``micro_batch_lengths`` and ``elem_counts_per_gb``. Every other call is NeMo-RL's own.
  Where NeMo-RL's worker pads every micro-batch to the longest (pipeline parallelism with the ``pad_to_longest``
  opt-out), NeMo-RL's own sharding of the same call (its packer, the policy's
  ``sequence_packing.algorithm``) is priced beside slime-ext's plan the same way (:func:`.plan.choose_padded`), and
  when it is predicted faster its shards are returned unchanged: the switch never runs a plan predicted slower than
  NeMo-RL's own of the same call.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from slime_ext.patches import in_context
from slime_ext.patches.nemo_rl_host import WORKER_CLASS_PARAMETER, worker_class_position

from .plan import PaddedChoice, ShardPlan, choose_padded, micro_batch_rows, plan_shards
from .settings import PAD_TO_LONGEST_FIX, NemoRLSettingError, Options, PolicyLayout, layout_from_config, run_as_packing
from .worker import WORKER_CLASS_FQN, check_worker_environment, missing_slime_ext_named

logger = logging.getLogger("slime_ext.integrations.nemo_rl")

__all__ = ["STATE", "ShardPass", "make_policy_init", "make_shard_by_batch_size", "make_shard_for"]

#: the attribute a patched Policy keeps its layout in
LAYOUT_ATTRIBUTE = "_slime_ext_layout"


@dataclass(frozen=True)
class ShardPass:
    """The shard call in progress: the policy's layout and the pass (``forward_only``: a log-prob pass)."""

    layout: PolicyLayout
    forward_only: bool


@dataclass
class State:
    """The process's integration state: the options, and the last plan made and, where NeMo-RL's own plan was a
    candidate, the last choice between them (for logs, tests and benchmarks)."""

    options: Options = field(default_factory=Options)
    costs: Any = None
    last_plan: ShardPlan | None = None
    last_choice: PaddedChoice | None = None


STATE = State()
_current: contextvars.ContextVar[ShardPass | None] = contextvars.ContextVar("slime_ext_nemo_rl_pass", default=None)


def make_policy_init(original: Callable) -> Callable:
    position = worker_class_position(original)  # where worker_extension_cls_fqn goes when passed by position

    @functools.wraps(original)
    def __init__(self, cluster, config, *args, **kwargs):
        layout = layout_from_config(config, STATE.options.pad_to_longest)
        converted = run_as_packing(config)
        if layout.variable_seq_lengths:
            args, kwargs = _with_worker_class(args, kwargs, position)
            check_worker_environment(worker_executable())
        if converted is not None:
            logger.warning("slime-ext: policy.dynamic_batching is run as sequence packing (same caps: train %d, "
                           "log-prob %d tokens); slime-ext's micro-batches are packed, never padded to their longest "
                           "row", layout.train_mb_tokens, layout.logprob_mb_tokens)
        with missing_slime_ext_named(layout.variable_seq_lengths):
            original(self, cluster, converted if converted is not None else config, *args, **kwargs)
        setattr(self, LAYOUT_ATTRIBUTE, layout)

    return __init__


def worker_executable() -> str:
    """The Python environment NeMo-RL's registry names for slime-ext's worker class (NeMo-RL's own lookup)."""
    from nemo_rl.distributed.ray_actor_environment_registry import get_actor_python_env

    return get_actor_python_env(WORKER_CLASS_FQN)


def _with_worker_class(args: tuple, kwargs: dict, position: int) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with slime-ext's worker class as ``worker_extension_cls_fqn``, where the caller passed it
    (by position or keyword) or left it out; refuses a class of the caller's."""
    given = args[position] if len(args) > position else kwargs.get(WORKER_CLASS_PARAMETER)
    if given not in (None, WORKER_CLASS_FQN):
        raise NemoRLSettingError(f"{WORKER_CLASS_PARAMETER} = {given!r}: under pipeline parallelism slime-ext runs its "
                                 f"own worker class ({WORKER_CLASS_FQN}: packed micro-batches at their own length); "
                                 f"{PAD_TO_LONGEST_FIX} to keep your class and NeMo-RL's pad to the longest")
    if len(args) > position:  # given by position (None included): replaced there
        return (*args[:position], WORKER_CLASS_FQN, *args[position + 1:]), kwargs
    return args, {**kwargs, WORKER_CLASS_PARAMETER: WORKER_CLASS_FQN}


def make_shard_for(forward_only: bool) -> Callable[[Callable], Callable]:
    """``make`` of the ``_shard_for_train`` (``forward_only=False``) and ``_shard_for_logprob`` patches: the pass is
    current while NeMo-RL's own method runs; a Policy built before the switch was on (no layout) runs untouched."""

    def shard_pass(policy: Any) -> ShardPass | None:
        layout = getattr(policy, LAYOUT_ATTRIBUTE, None)
        return None if layout is None else ShardPass(layout, forward_only)

    return in_context(_current, shard_pass)


def _as_list(values: Any) -> list[int]:
    return [int(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def make_shard_by_batch_size(original: Callable) -> Callable:
    @functools.wraps(original)
    def shard_by_batch_size(self, shards, batch_size=None, allow_uneven_shards=False, dynamic_batching_args=None,
                            sequence_packing_args=None):
        current = _current.get()
        if current is None or sequence_packing_args is None:
            return original(self, shards, batch_size=batch_size, allow_uneven_shards=allow_uneven_shards,
                            dynamic_batching_args=dynamic_batching_args, sequence_packing_args=sequence_packing_args)
        args = sequence_packing_args
        result = plan_shards(_as_list(self.data[args["input_lengths_key"]]),
                             parallel=current.layout.parallel(shards), batch_size=batch_size,
                             cap=args["max_tokens_per_microbatch"], pad_multiple=args["sequence_length_pad_multiple"],
                             forward_only=current.forward_only, cost_model=STATE.costs,
                             pad_to_longest=current.layout.padded_to_longest)
        STATE.last_plan, STATE.last_choice = result, None
        if current.layout.padded_to_longest:
            try:
                theirs = original(self, shards, batch_size=batch_size, sequence_packing_args=args)
            except Exception as exc:  # NeMo-RL's own cannot shard this call (its packer refuses a row over the cap)
                theirs = exc
            STATE.last_choice = _against_nemo_rl(result, theirs)
            _log_choice(result, STATE.last_choice)
            if STATE.last_choice.theirs_wins:
                return theirs
        return _shards_of(self, result), result.sorted_indices

    return shard_by_batch_size


def _against_nemo_rl(result: ShardPlan, theirs: tuple[list[Any], list[int]] | Exception) -> PaddedChoice:
    """slime-ext's plan (planned with the pad, so priced once: its ``padded_time``) and NeMo-RL's own
    ``(shards, sorted_indices)`` of the same call (or what it raised), priced alike (:func:`.plan.choose_padded`)."""
    if isinstance(theirs, Exception):
        return PaddedChoice(result.padded_time, None, f"NeMo-RL's shard_by_batch_size raised {theirs!r}")
    shards, sorted_indices = theirs
    rows, start = [], 0
    for shard in shards:
        count = sum(shard.elem_counts_per_gb)
        rows.append(sorted_indices[start:start + count])
        start += count
    their_rows = micro_batch_rows(rows, [shard.micro_batch_indices for shard in shards],
                                  [shard.elem_counts_per_gb for shard in shards])
    return choose_padded(result.padded_time, their_rows, result.padded_lengths, parallel=result.schedule.parallel,
                         cap=result.cap, forward_only=result.forward_only, cost_model=STATE.costs)


def _log_choice(result: ShardPlan, choice: PaddedChoice) -> None:
    logger.debug("slime-ext: %s pass padded to the longest micro-batch: slime-ext's plan %.6g, NeMo-RL's own %s; "
                 "%s runs", "log-prob" if result.forward_only else "training", choice.ours,
                 f"{choice.theirs:.6g}" if choice.theirs is not None else f"no candidate ({choice.why_not})",
                 "NeMo-RL's" if choice.theirs_wins else "slime-ext's")


def _shards_of(batch: Any, result: ShardPlan) -> list[Any]:
    """NeMo-RL's shards of ``batch`` as ``result`` plans them (its own ``SlicedDataDict`` and row selection)."""
    from nemo_rl.distributed.batched_data_dict import SlicedDataDict

    shards = []
    for r in range(result.dp_size):
        shard = SlicedDataDict.from_batches([batch.select_indices(list(result.rows[r]))])
        shard.micro_batch_indices = [[list(b) for b in gb] for gb in result.micro_batch_indices[r]]
        shard.micro_batch_lengths = [list(gb) for gb in result.micro_batch_lengths[r]]
        shard.elem_counts_per_gb = list(result.elem_counts_per_gb[r])
        shards.append(shard)
    return shards
