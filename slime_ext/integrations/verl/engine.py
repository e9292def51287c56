"""slime-ext's ``prepare_micro_batches`` for verl's Megatron engine (the engine depth).

verl's ``MegatronEngine.forward_backward_batch`` calls ``prepare_micro_batches(data, dp_group,
num_batches_divided_by, same_micro_num_in_dp, min_num_micro_batch)`` (imported into
``verl.workers.engine.megatron.transformer_impl`` by name) and expects back ``(micro_batches, indices)``: the
micro-batches as TensorDicts and, per micro-batch, the positions of its samples in ``data``; every DP rank must
return the same count, a multiple of ``num_batches_divided_by`` under VPP. verl puts the outputs back in input
order with those indices. The replacement built here keeps that contract:

1. reads each sample's length as verl does (the offsets of a nested ``input_ids``, else ``attention_mask`` sums) and
   the cap (``max_token_len_per_gpu`` times the context-parallel size verl stores as ``sp_size``);
2. drafts this rank's plan from its own samples only (:func:`slime_ext.integrations.verl.plan.draft_rank`) with the
   job's pipeline layout from megatron-core's parallel state and the model's cost (:func:`cost_model_for`); a pass
   without gradients (verl's log-prob and reference passes, :func:`forward_only_now`) is planned forward-only;
3. all-reduces (MAX) the draft's ballot over the DP group (:func:`agree_over`: one collective of a few hundred
   bytes, whatever the DP size) and reads the agreed count from it (:func:`~slime_ext.integrations.verl.plan.agree`);
4. finishes this rank's micro-batches at that count (:func:`~slime_ext.integrations.verl.plan.finish_rank`) and
   returns them (``tensordict_utils.index_select_tensor_dict``, verl's own) with their indices.

It falls back to verl's own function, saying so once per reason, where slime-ext's plan does not apply: static
micro-batches (``use_dynamic_bsz`` off), ``force_group_size > 1`` (reward-model pairs), or a caller that does not
want one count across DP (``same_micro_num_in_dp=False``). verl's dynamic context parallelism never calls
``prepare_micro_batches`` (its own ``DynamicCPScheduler`` plans), so it is untouched.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
from typing import Any, Callable

from slime_ext.schedule import CostModel, CostProfile

from .plan import Ballot, EngineLayout, RankDraft, RankPlan, agree, check_rank_plan, draft_rank, finish_rank

logger = logging.getLogger("slime_ext.integrations.verl")

#: a calibrated cost profile (``slime-ext calibrate``) to plan with instead of the model's FLOPs
PROFILE_ENV = "SLIME_EXT_VERL_PROFILE"

#: the engine whose ``forward_backward_batch`` is running (set by the wrapper in :mod:`.patches`)
current_engine: contextvars.ContextVar[Any] = contextvars.ContextVar("slime_ext_verl_engine", default=None)

_said: set[str] = set()
_last_plan: RankPlan | None = None


def last_plan() -> RankPlan | None:
    """This rank's plan of the last call in this process (for logs and tests)."""
    return _last_plan


def _say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        logger.warning("slime-ext: verl's own prepare_micro_batches plans this batch: %s", reason)


def fallback_reason(data: Any, same_micro_num_in_dp: bool) -> str | None:
    """Why slime-ext's plan does not apply to this call, or ``None`` when it does."""
    from verl.utils import tensordict_utils as tu

    if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        return "static micro-batches (use_dynamic_bsz=False): verl chunks them by micro_batch_size_per_gpu"
    if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
        return "force_group_size > 1 (samples that must share a micro-batch) is not planned by slime-ext"
    if not same_micro_num_in_dp:
        return "same_micro_num_in_dp=False: the caller wants each rank's own count"
    return None


def sample_lengths(data: Any) -> list[int]:
    """Each sample's token count, as verl's ``rearrange_micro_batches`` reads it."""
    input_ids = data["input_ids"]
    if input_ids.is_nested:
        return input_ids.offsets().diff().tolist()
    return data["attention_mask"].sum(dim=1).tolist()


def _cap(data: Any) -> int:
    from verl.utils import tensordict_utils as tu

    if "max_token_len_per_gpu" not in data.keys():
        raise ValueError("max_token_len_per_gpu is not in the batch but use_dynamic_bsz is on; set "
                         "*.ppo_max_token_len_per_gpu / *.log_prob_max_token_len_per_gpu in verl's config")
    per_gpu = tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None)
    sp_size = tu.get_non_tensor_data(data=data, key="sp_size", default=1)
    return int(per_gpu) * int(sp_size or 1)


def _device():
    """Where verl's own collectives put their tensors: the accelerator's current device, or the CPU."""
    import torch
    from verl.utils.device import get_device_id, get_device_name

    name = get_device_name()
    return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())


def all_reduce_max(vector: Any, dp_group: Any) -> Any:
    """The element-wise MAX of every DP rank's ``vector`` (this rank's own without a group): one ``all_reduce`` of
    float64 (MAX selects a value, so every rank gets the same bits)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    if dp_group is None or not dist.is_initialized() or dist.get_world_size(group=dp_group) == 1:
        return np.asarray(vector, dtype=np.float64)
    t = torch.as_tensor(np.asarray(vector, dtype=np.float64)).to(_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
    return t.cpu().numpy()


def agree_over(draft: RankDraft | Exception, layout: EngineLayout, cap: int, rank: int, dp_group: Any) -> Any:
    """Stage 3 over the DP group: all-reduce this rank's ballot, agree on the count. A draft that raised
    (``draft`` is the exception) still takes part in the collective with a failed ballot, and its exception is
    raised after it, while every other rank raises the ``ScheduleError`` :func:`agree` names: no rank is left
    waiting in the collective."""
    if isinstance(draft, Exception):
        ballot = Ballot.failed_by(rank)
    else:
        ballot = draft.ballot
    reduced = all_reduce_max(ballot.vector(), dp_group)
    if isinstance(draft, Exception):
        raise draft
    return agree(reduced, layout, cap, mine=draft)


def forward_only_now() -> bool:
    """Whether this pass has no backward: verl runs its log-prob and reference passes (``infer_batch``:
    ``forward_backward_batch(..., forward_only=True)``) under ``torch.no_grad()``, its updates with gradients on."""
    import torch

    return not torch.is_grad_enabled()


def layout_now(num_batches_divided_by: int | None) -> EngineLayout:
    """The pipeline layout from megatron-core's parallel state (one stage when it is not initialised)."""
    try:
        from megatron.core import parallel_state as mpu

        pp = mpu.get_pipeline_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
        vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    except ImportError:
        pp, vpp = 1, 1
    return EngineLayout(pp_size=int(pp), vpp_size=int(vpp), vpp_group=num_batches_divided_by)


@functools.lru_cache(maxsize=4)
def _profile(path: str) -> CostProfile:
    return CostProfile.load(path)


def cost_model_for(engine: Any) -> CostModel | CostProfile | None:
    """The planner's cost: the profile named by ``SLIME_EXT_VERL_PROFILE``, else FLOPs from the engine's megatron
    ``TransformerConfig`` (and the HF vocabulary), else tokens (``None``)."""
    path = os.environ.get(PROFILE_ENV)
    if path:
        return _profile(path)
    tf = getattr(engine, "tf_config", None)
    if tf is None:
        return None
    hf = getattr(getattr(engine, "model_config", None), "hf_config", None)
    dims = dict(hidden_size=tf.hidden_size, num_layers=tf.num_layers, num_attention_heads=tf.num_attention_heads,
                num_query_groups=getattr(tf, "num_query_groups", None), kv_channels=getattr(tf, "kv_channels", None),
                ffn_hidden_size=getattr(tf, "ffn_hidden_size", None),
                vocab_size=int(getattr(hf, "vocab_size", 0) or 0),
                swiglu=bool(getattr(tf, "gated_linear_unit", False)))
    experts = getattr(tf, "num_moe_experts", None)
    if experts:
        dims.update(num_experts=experts, moe_router_topk=getattr(tf, "moe_router_topk", 2),
                    moe_ffn_hidden_size=getattr(tf, "moe_ffn_hidden_size", None))
    try:
        return CostModel(**{k: v for k, v in dims.items() if v is not None})
    except ValueError as exc:  # an unusual config: plan by tokens rather than fail the step
        _say_once(f"no FLOPs model from the engine's config ({exc}); balancing by tokens")
        return None


def make_prepare_micro_batches(original: Callable) -> Callable:
    """The replacement for verl's ``prepare_micro_batches`` (same signature; falls back to ``original``)."""

    @functools.wraps(original)
    def prepare_micro_batches(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                              min_num_micro_batch=None, use_dynamic_bsz_balance=True):
        global _last_plan
        reason = fallback_reason(data, same_micro_num_in_dp)
        if reason is not None:
            _say_once(reason)
            return original(data, dp_group=dp_group, num_batches_divided_by=num_batches_divided_by,
                            same_micro_num_in_dp=same_micro_num_in_dp, min_num_micro_batch=min_num_micro_batch,
                            use_dynamic_bsz_balance=use_dynamic_bsz_balance)
        from verl.utils import tensordict_utils as tu
        import torch.distributed as dist

        distributed = dp_group is not None and dist.is_initialized()
        rank = dist.get_rank(group=dp_group) if distributed else 0
        layout = layout_now(num_batches_divided_by)
        cap = _cap(data)
        try:  # 1. this rank's samples only
            draft: RankDraft | Exception = draft_rank(sample_lengths(data), cap, layout, rank=rank,
                                                      min_count=min_num_micro_batch,
                                                      cost_model=cost_model_for(current_engine.get()),
                                                      forward_only=forward_only_now())
        except Exception as exc:  # noqa: BLE001 -- raised after the collective (see agree_over)
            draft = exc
        agreement = agree_over(draft, layout, cap, rank, dp_group)  # 2.-3. one all-reduce
        plan = finish_rank(draft, agreement)  # 4.
        check_rank_plan(plan.micro_batches, plan.count, draft.lengths, cap, layout.align, rank)
        _last_plan = plan
        indices = [list(mb) for mb in plan.micro_batches]
        return [tu.index_select_tensor_dict(data, idx) for idx in indices], indices

    prepare_micro_batches.__slime_ext__ = True
    return prepare_micro_batches
