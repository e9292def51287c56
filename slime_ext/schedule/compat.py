"""slime's flags -> the planner's request (:func:`request_from_args`, which the slime integration also uses), and
:func:`build_dp_schedule`, the drop-in for upstream's ``slime.utils.dp_schedule.build_dp_schedule``.

The layout is slime's ``train_parallel_config`` completed from Megatron's args (:data:`LAYOUT_ARGS`): a field the
dict lacks is read off ``args``, a field both give must agree; under VPP the p2p mode defaults to on, as in
Megatron-LM. The cost is the profile at ``args.cost_profile``, else FLOPs from the model dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .config import LAYOUT_FLAGS, BatchConfig, ParallelConfig
from .cost import CostModel
from .dp_schedule import DPSchedule
from .errors import ScheduleError
from .planner_config import PlannerConfig
from .profile import CostProfile
from .request import PlanRequest, plan
from .validate import is_int, read_arg

#: ``ParallelConfig`` fields that slime's parallel dict lacks, and the Megatron args (argparse dests) they come from
LAYOUT_ARGS = {"pp_size": "pipeline_model_parallel_size", "overlap_p2p_comm": "overlap_p2p_comm",
               **{flag: flag for flag in LAYOUT_FLAGS}}


def parallel_from_args(args: Any, train_parallel_config: Mapping[str, Any] | ParallelConfig) -> ParallelConfig:
    """The layout: slime's ``train_parallel_config`` (or a :class:`ParallelConfig`) completed from ``args``."""
    given = train_parallel_config
    if isinstance(given, ParallelConfig):
        given = given.to_dict()
    elif not isinstance(given, Mapping):
        return ParallelConfig.from_dict(given)  # refuses it, naming what it takes
    vpp = given.get("vpp_size") or 1
    interleaved = not is_int(vpp) or vpp > 1  # a bad vpp_size is left to ParallelConfig's message
    pp = given.get("pp_size") if given.get("pp_size") is not None else read_arg(args, "pipeline_model_parallel_size")
    pipelined = not is_int(pp) or pp > 1
    extra = {}
    for key, flag in LAYOUT_ARGS.items():
        ours, theirs = given.get(key), read_arg(args, flag)
        if key == "overlap_p2p_comm" and not interleaved:
            continue  # without VPP there is no p2p mode to choose (ParallelConfig keeps False)
        if key.startswith("account_for_") and not pipelined:
            continue  # with one stage there is nothing to split (ParallelConfig keeps False)
        if ours is None and theirs is not None:
            extra[key] = theirs
        elif ours is not None and theirs is not None and ours != theirs:
            raise ScheduleError(
                f"the parallel layout says {key}={ours!r} but args.{flag}={theirs!r}; they must agree (slime's "
                f"train_parallel_config has no {key}: leave it out and the planner reads args.{flag}, or pass the "
                f"same value in both)"
            )
    if interleaved and given.get("overlap_p2p_comm") is None and "overlap_p2p_comm" not in extra:
        extra["overlap_p2p_comm"] = True  # Megatron-LM training's default with VPP
    if isinstance(train_parallel_config, ParallelConfig) and not extra:
        return train_parallel_config
    return ParallelConfig.from_dict({**given, **extra})


def cost_from_args(args: Any) -> CostModel | CostProfile | None:
    """The profile at ``args.cost_profile`` when set, else :meth:`CostModel.from_args` (``None``: tokens)."""
    path = read_arg(args, "cost_profile")
    if path:
        if not isinstance(path, str):
            raise ScheduleError(f"cost_profile = {path!r} must be the path of a JSON file from `slime-ext calibrate`")
        return CostProfile.load(path)
    return CostModel.from_args(args)


@dataclass(frozen=True)
class PlannerInputs:
    """What a :class:`~.request.PlanRequest` takes besides the samples, read off slime's ``args``."""

    parallel: ParallelConfig
    batch: BatchConfig
    cost_model: CostModel | CostProfile | None


def planner_inputs(args: Any, train_parallel_config: Mapping[str, Any] | ParallelConfig, *,
                   global_batch_size: int | None = None) -> PlannerInputs:
    """The layout, the batch flags (``global_batch_size`` overrides ``args``') and the cost, read off ``args``."""
    parallel = parallel_from_args(args, train_parallel_config)
    num_layers = read_arg(args, "num_layers")
    placed = any(getattr(parallel, flag) not in (None, False) for flag in LAYOUT_FLAGS)
    if parallel.pp_size > 1 and num_layers is not None and placed:
        parallel.stage_layers(num_layers)  # the layout flags the user set, refused where Megatron refuses
    return PlannerInputs(parallel=parallel,
                         batch=BatchConfig.from_args(args, global_batch_size=global_batch_size),
                         cost_model=cost_from_args(args))


def request_from_args(args: Any, train_parallel_config: Mapping[str, Any] | ParallelConfig,
                      total_lengths: Sequence[int], *, global_batch_size: int | None = None,
                      rollout_indices: Sequence[int] | None = None, loss_tokens: Sequence[int] | None = None,
                      config: PlannerConfig | None = None) -> PlanRequest:
    """The :class:`~.request.PlanRequest` of one slime rollout, read off ``args`` (:func:`planner_inputs`)."""
    inputs = planner_inputs(args, train_parallel_config, global_batch_size=global_batch_size)
    return PlanRequest(lengths=total_lengths, parallel=inputs.parallel, batch=inputs.batch,
                       rollout_ids=rollout_indices, loss_tokens=loss_tokens, cost_model=inputs.cost_model,
                       config=config)


def build_dp_schedule(args: Any, train_parallel_config: Mapping[str, Any] | ParallelConfig,
                      total_lengths: Sequence[int], *, global_batch_size: int | None = None,
                      rollout_indices: Sequence[int] | None = None, loss_tokens: Sequence[int] | None = None,
                      config: PlannerConfig | None = None) -> DPSchedule:
    """Plan one slime rollout (``rollout_indices[i]``: sample ``i``'s rollout id); the :class:`DPSchedule` unpacks as
    upstream's result."""
    return plan(request_from_args(args, train_parallel_config, total_lengths, global_batch_size=global_batch_size,
                                  rollout_indices=rollout_indices, loss_tokens=loss_tokens, config=config))
