"""slime-ext's plan inside Megatron-RL's process: what each patched Megatron-LM function does instead.

:mod:`slime_ext.patches.megatron_rl` says where each function enters Megatron-LM (and for which versions); this
module says what it does. Every replacement first asks whether the data in hand is slime-ext's (a packing context
carrying :class:`RankCollection` as ``.slime_ext``); when it is not, it calls Megatron-LM's original unchanged.

The flow of one rollout collection, in Megatron-RL's own order (``rl_utils.prepare_data_for_update``):

1. ``pack_all_trajectories`` -> :func:`pack_all_trajectories`: the rows are all-gathered over the DP group as
   Megatron-RL gathers them, their lengths read with Megatron-RL's ``get_actual_sequence_lengths``, and the whole
   collection planned once (:func:`.plan.plan_collection`, identical on every rank). This rank's micro-batches, all
   steps concatenated in plan order, become Megatron-RL's ``PackingContext``: the same fields and the same storage
   width (``seq_length``), but a micro-batch computes only its first ``L`` columns (its real tokens, each sequence
   aligned to ``2 * cp``, plus the tail padding sequence parallelism needs), and its ``PackedSeqParams`` list exactly
   its sequences. No empty micro-batch exists.
2. ``compute_logprobs_batch`` (``_compute_logprobs_batch`` in 0.16) -> :func:`compute_logprobs_batch`: the old-policy
   and reference log-prob passes run every micro-batch of the collection once through **one** call of
   megatron-core's schedule, forward only (pipelined; under VPP the interleaved schedule over every model chunk), in
   the order the forward-only pipeline model predicts fastest (:func:`.plan.logprob_order`), with Megatron-RL's own
   ``logprobs_forward_step``. The result has Megatron-RL's layout (``[micro-batches, seq_length - 1]``, broadcast from
   the last pipeline stage), so Megatron-RL's loss reads it unchanged.
3. ``load_packed_data_by_index`` -> :func:`load_packed_data_by_index`: Megatron-RL's own slicing, cut to the
   micro-batch's ``L`` tokens (``L - 1`` log-probs), with its exact ``PackedSeqParams``.
4. ``update_microbatch_calculator`` -> :func:`update_microbatch_calculator`: the calculator set to step 0's count
   (instead of ``ceil(ratio * bins)``), and the plan logged.
5. ``get_grpo_data_iterator`` -> :func:`get_grpo_data_iterator`: checks the settings once
   (:class:`.settings.PlanSettings`), keeps the model chunks for the log-prob passes, and under VPP returns one
   iterator per model chunk (megatron-core's interleaved schedule takes a list). Megatron-RL's data loader already
   yields the micro-batches in plan order, step after step, cycled for ``--grpo-iterations``.
6. ``training.train_step`` -> :func:`train_step`: before each optimizer step, the calculator is set to that step's
   count; the LR scheduler is stepped by the samples the step trains (``samples_per_step``), not by micro-batches (the
   increment replaced is checked: :class:`slime_ext.training.lr.StepSizedScheduler`);
   under VPP the forward step knows which model chunk runs. ``rl_utils.get_iteration_sequence_count`` ->
   :func:`get_iteration_sequence_count`: the step's samples, so ``consumed_train_samples`` counts each sample once.
7. Under VPP, Megatron-RL asks "am I the last stage?" without a virtual stage (``train_rl.forward_step``:
   ``is_pipeline_last_stage()``; ``get_logprobs``: ``is_pp_last_stage(pp_group)``), which is true for every model
   chunk of the last pipeline rank. :func:`is_pipeline_last_stage` and :func:`is_pp_last_stage` answer for the
   chunk that runs (only while one of slime-ext's forward steps runs one; otherwise Megatron's answer). The
   reference pass swaps the reference weights into every chunk, not only ``model[0]`` (:func:`capture_reference`).

A micro-batch loaded outside the step that planned it is an error (:class:`RankCollection.expect`), so the step
counter and the data can never silently disagree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import logging
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from slime_ext.training.lr import StepSizedScheduler

from .plan import CollectionPlan, plan_collection
from .settings import MegatronRLSettingError, Options, PlanSettings

logger = logging.getLogger("slime_ext.integrations.megatron_rl")

__all__ = ["RankCollection", "State", "STATE"]


# ------------------------------------------------------------------------------------------------ process state
@dataclass
class State:
    """What one training process knows: the options, the settings (read at the first collection), the model chunks,
    the reference weights of the chunks after the first (VPP only)."""

    options: Options = field(default_factory=Options)
    settings: PlanSettings | None = None
    model_chunks: list | None = None
    reference_id: int | None = None
    reference_chunks: list | None = None


STATE = State()
_local = threading.local()


@dataclass
class RankCollection:
    """This rank's part of the collection's plan, carried by Megatron-RL's ``PackingContext`` as ``.slime_ext``."""

    plan: CollectionPlan
    dp_rank: int
    #: this rank's micro-batches (global rows), steps concatenated; index = Megatron-RL's bin index
    bins: list[tuple[int, ...]]
    #: tokens each micro-batch computes (its row length ``L``)
    bin_tokens: list[int]
    step_starts: list[int]
    #: optimizer steps run on this collection so far (all passes); the next step is ``steps_done % num_steps``
    steps_done: int = 0
    #: log-prob passes run on this collection (1: old policy, 2: reference)
    logprob_passes: int = 0
    #: the step running now and the last one finished (for the sample count)
    current_step: int | None = None
    last_step: int | None = None

    @property
    def num_steps(self) -> int:
        return self.plan.num_steps

    def bins_of_step(self, step: int) -> range:
        return range(self.step_starts[step], self.step_starts[step + 1])

    def expect(self, bin_idx: int) -> None:
        """During a training step only that step's micro-batches may be loaded."""
        if self.current_step is not None and bin_idx not in self.bins_of_step(self.current_step):
            raise RuntimeError(
                f"slime-ext: micro-batch {bin_idx} was loaded during optimizer step {self.current_step} of the "
                f"collection, whose micro-batches are {self.bins_of_step(self.current_step)}; the data iterator and "
                f"the step counter disagree (was an iteration skipped, or the iterator consumed elsewhere?)")


def collection_of(packing_context: Any) -> RankCollection | None:
    return getattr(packing_context, "slime_ext", None)


def _runtime_state() -> Any:
    from megatron.rl import rl_utils

    return rl_utils.get_rl_runtime_state()


def current_collection() -> RankCollection | None:
    return collection_of(_runtime_state().packing_context)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _dataclass_kwargs(cls: Any, **values: Any) -> dict:
    """The keywords ``cls`` (a dataclass of this Megatron-LM) declares, out of ``values``; its other required fields
    are ``None`` (e.g. 0.16's ``packed_attention_mask``, which the packed path never reads)."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in values.items() if k in names}
    for name, f in names.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[name] = None
    return kwargs


def _signature_kwargs(fn: Callable, **values: Any) -> dict:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in values.items() if k in params}


# ------------------------------------------------------------------------------------------------ 1. plan and pack
def packed_seq_params(lengths: list[int], multiple: int, total: int, device: Any) -> Any:
    """megatron-core ``PackedSeqParams`` (THD) for one micro-batch of ``total`` tokens holding sequences of
    ``lengths`` real tokens, each in a slot rounded up to ``multiple`` (``2 * cp`` under context parallelism), the
    tail past the last slot (if any) one more sequence of padding that attends to itself: Megatron-RL's layout of a
    packed bin (``create_packed_seq_params_for_bin``), at the micro-batch's own length instead of ``seq_length``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    widths = [-(-length // multiple) * multiple for length in lengths]
    bounds = [0, *itertools.accumulate(widths)]
    real = list(lengths)
    if total > bounds[-1]:
        real.append(total - bounds[-1])
        widths.append(total - bounds[-1])
        bounds.append(total)
    cu = torch.tensor([0, *itertools.accumulate(real)], dtype=torch.int32, device=device)
    aligned = multiple > 1
    padded = torch.tensor(bounds, dtype=torch.int32, device=device) if aligned else None
    values = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                  cu_seqlens_kv_padded=padded, max_seqlen_q=max(widths), max_seqlen_kv=max(widths),
                  total_tokens=int(total), pad_between_seqs=aligned)
    return PackedSeqParams(**_signature_kwargs(PackedSeqParams, **values))


def _gather(tensor: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """Every DP rank's rows, in rank order (Megatron-RL's ``pack_all_trajectories`` gathers them the same way)."""
    if world == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def settings() -> PlanSettings:
    """The job's plan settings, read off Megatron-LM's args at first use (refusing what slime-ext cannot honour)."""
    if STATE.settings is None:
        from megatron.training import get_args

        STATE.settings = PlanSettings.from_args(get_args(), STATE.options)
        s = STATE.settings
        logger.info(f"slime-ext plans Megatron-RL's micro-batches: dp={s.parallel.dp_size} pp={s.parallel.pp_size} "
                    f"vpp={s.parallel.vpp_size} cp={s.parallel.cp_size}, {s.num_steps} optimizer steps per "
                    f"collection, at most {s.cap} tokens per micro-batch, cost: "
                    f"{type(s.cost_model).__name__ if s.cost_model is not None else 'tokens'}")
    return STATE.settings


def make_pack_all_trajectories(original: Callable) -> Callable:
    """Megatron-RL's ``pack_all_trajectories(trajs, generation_masks, inference_logprobs, global_advantages,
    bin_size, max_sequences_per_bin, packing_algo) -> PackingContext``, planned by slime-ext (module docstring, 1)."""

    def pack_all_trajectories(trajs, generation_masks, inference_logprobs, global_advantages, bin_size,
                              max_sequences_per_bin, packing_algo):
        from megatron.core import mpu
        from megatron.rl import sequence_packing_utils as spu

        plan_settings = settings()
        tokenizer = spu.get_tokenizer()
        group, world = mpu.get_data_parallel_group(), mpu.get_data_parallel_world_size()
        device = _device()
        trajs = _gather(trajs.to(device), group, world)
        generation_masks = _gather(generation_masks.to(device), group, world)
        if inference_logprobs is not None:
            inference_logprobs = _gather(inference_logprobs.to(device), group, world)
        lengths = [int(x) for x in spu.get_actual_sequence_lengths(trajs, tokenizer.pad)]
        plan = plan_collection(lengths, parallel=plan_settings.parallel, num_steps=plan_settings.num_steps,
                               cap=plan_settings.cap, cost_model=plan_settings.cost_model,
                               seq_length_multiple=plan_settings.seq_length_multiple,
                               token_multiple=plan_settings.token_multiple)
        dp_rank = mpu.get_data_parallel_rank()
        bins = plan.rank_micro_batches(dp_rank)
        bin_tokens = plan.rank_micro_batch_tokens(dp_rank)
        multiple = plan.seq_length_multiple
        width = int(bin_size)
        if max(bin_tokens) > width:
            raise MegatronRLSettingError(f"a micro-batch of {max(bin_tokens)} tokens does not fit Megatron-RL's "
                                         f"buffers of bin_size={width}; make --seq-length a multiple of "
                                         f"{plan.token_multiple} (the tensor-parallel row multiple)")
        packed_trajs = torch.full((len(bins), width), tokenizer.pad, dtype=trajs.dtype, device=device)
        position_ids = torch.zeros((len(bins), width), dtype=torch.long, device=device)
        loss_mask = torch.zeros((len(bins), width), dtype=torch.float, device=device)
        seq_starts: dict[int, list[int]] = {}
        seq_to_bin: list[int | None] = [None] * len(lengths)
        for b, rows in enumerate(bins):
            position, starts = 0, []
            for row in rows:
                length = lengths[row]
                starts.append(position)
                packed_trajs[b, position:position + length] = trajs[row, :length]
                position_ids[b, position:position + length] = torch.arange(length, device=device)
                loss_mask[b, position:position + length] = generation_masks[row, :length].float()
                seq_to_bin[row] = b
                position += -(-length // multiple) * multiple
            starts.append(position)
            seq_starts[b] = starts
        packing_info = spu.PackingInfo(**_dataclass_kwargs(
            spu.PackingInfo, bin_seq_indices=[list(rows) for rows in bins], seq_starts=seq_starts,
            seq_lengths=lengths, seq_to_bin_idx=seq_to_bin, packing_algo="slime-ext"))
        packer = spu.SequencePacker(**_signature_kwargs(  # seq_length_multiple: Megatron-LM after core_v0.19
            spu.SequencePacker, bin_size=width, pad_token=tokenizer.pad,
            max_sequences_per_bin=max(int(max_sequences_per_bin), *map(len, bins)), seq_length_multiple=multiple))
        context = spu.PackingContext(**_dataclass_kwargs(
            spu.PackingContext, bin_size=width, packer=packer, packing_info=packing_info,
            original_generation_masks=generation_masks, original_trajs=trajs, packed_trajs=packed_trajs,
            packed_position_ids=position_ids, packed_loss_mask=loss_mask,
            original_inference_logprobs=inference_logprobs,
            bin_advantages=[global_advantages[list(rows)] for rows in bins],
            cached_packed_seq_params=[packed_seq_params([lengths[r] for r in rows], multiple, bin_tokens[b], device)
                                      for b, rows in enumerate(bins)]))
        context.slime_ext = RankCollection(plan=plan, dp_rank=dp_rank, bins=bins, bin_tokens=bin_tokens,
                                           step_starts=plan.step_starts())
        real = sum(lengths[r] for rows in bins for r in rows)
        logger.info(f"slime-ext: {len(plan.step_rows)} steps of {list(plan.samples_per_step)} samples "
                    f"({len(plan.padding_rows)} padding rows not trained); DP rank {dp_rank}: "
                    f"{list(plan.num_microbatches)} micro-batches per step, {sum(bin_tokens)} tokens computed for "
                    f"{real} real")
        return context

    return pack_all_trajectories


# ------------------------------------------------------------------------------------------------ 2. log-prob passes
def _set_num_microbatches(count: int, dp_size: int) -> None:
    """megatron-core's calculator answers ``count`` micro-batches per rank (``global_batch_size = count * dp``,
    micro-batch size 1), as Megatron-RL reconfigures it for its own bins."""
    from megatron.core import num_microbatches_calculator as nmc

    values = dict(rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
                  rampup_batch_size=None, global_batch_size=count * dp_size, micro_batch_size=1,
                  data_parallel_size=dp_size, decrease_batch_size_if_needed=False)
    nmc.reconfigure_num_microbatches_calculator(**_signature_kwargs(nmc.reconfigure_num_microbatches_calculator,
                                                                    **values))
    if nmc.get_num_microbatches() != count:
        raise RuntimeError(f"slime-ext: megatron-core's calculator answers {nmc.get_num_microbatches()} "
                           f"micro-batches after being set to {count}")


@contextlib.contextmanager
def _virtual_stage(stage: int | None, vpp_size: int):
    previous = getattr(_local, "stage", None)
    _local.stage = None if stage is None else (int(stage), int(vpp_size))
    try:
        yield
    finally:
        _local.stage = previous


def _chunk_index(model: Any) -> int | None:
    from megatron.core.utils import get_attr_wrapped_model

    stage = get_attr_wrapped_model(model, "vp_stage", allow_none=True)
    if stage is not None:
        return int(stage)
    for index, chunk in enumerate(STATE.model_chunks or []):
        if chunk is model:
            return index
    raise RuntimeError("slime-ext: a forward step ran a model chunk that is neither tagged with its vp_stage nor one "
                       "of the training model's chunks")


def in_chunk(forward_step: Callable, vpp_size: int) -> Callable:
    """``forward_step`` run knowing which virtual pipeline stage its model chunk is (VPP only; else itself)."""
    if vpp_size <= 1:
        return forward_step

    @functools.wraps(forward_step)
    def run(data_iterator, model, *args, **kwargs):
        with _virtual_stage(_chunk_index(model), vpp_size):
            return forward_step(data_iterator, model, *args, **kwargs)

    return run


@contextlib.contextmanager
def _reference_weights(chunks: list, reference: bool):
    """The reference pass under VPP: Megatron-RL loads the reference weights into ``model[0]`` only; the other
    chunks get theirs here (captured by :func:`capture_reference`) and their own back afterwards."""
    if not reference or len(chunks) < 2:
        yield
        return
    if STATE.reference_chunks is None or len(STATE.reference_chunks) != len(chunks) - 1:
        raise RuntimeError("slime-ext: the reference weights of the model chunks after the first were not captured")
    saved = [{k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
              for k, v in chunk.state_dict().items()} for chunk in chunks[1:]]
    for chunk, weights in zip(chunks[1:], STATE.reference_chunks):
        chunk.load_state_dict(weights)
    try:
        yield
    finally:
        for chunk, weights in zip(chunks[1:], saved):
            chunk.load_state_dict(weights)


def capture_reference(chunks: list, ref_state_dict: dict) -> None:
    """Under VPP, the reference weights of the chunks after the first, taken when the training loop's reference
    state dict (``model[0]``'s) is first seen. They are the reference only if ``model[0]`` still holds it then (a
    run that starts from the reference checkpoint); a resumed run does not, and is refused."""
    current = chunks[0].state_dict()
    same = current.keys() == ref_state_dict.keys() and all(
        torch.equal(v.detach().cpu(), ref_state_dict[k].detach().cpu())
        for k, v in current.items() if isinstance(v, torch.Tensor) and isinstance(ref_state_dict[k], torch.Tensor))
    if not same:
        raise MegatronRLSettingError(
            "slime-ext with virtual pipeline parallelism needs the reference weights of every model chunk, and "
            "Megatron-RL keeps only model[0]'s (training.py: ref_state_dict); this run's model[0] no longer holds "
            "them (a resumed run), so the other chunks' reference weights are unknown. Start the run from the "
            "reference checkpoint, or resume without --virtual-pipeline-model-parallel-size")
    STATE.reference_chunks = [{k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in chunk.state_dict().items()} for chunk in chunks[1:]]
    STATE.reference_id = id(ref_state_dict)


def _is_last_pp_rank(pp_group: Any) -> bool:
    return pp_group is None or pp_group.rank() == pp_group.size() - 1


def make_compute_logprobs_batch(original: Callable) -> Callable:
    """Megatron-RL's ``compute_logprobs_batch`` (module docstring, 2): one schedule call for the collection."""

    def compute_logprobs_batch(model, data_loader, forward_backward_func, packing_context, trajs_batch_size,
                               seq_length, logprobs_batch_size, decoder_seq_length, dtype, pp_group, is_correction,
                               *rest, **kwargs):
        collection = collection_of(packing_context)
        if collection is None:
            return original(model, data_loader, forward_backward_func, packing_context, trajs_batch_size,
                            seq_length, logprobs_batch_size, decoder_seq_length, dtype, pp_group, is_correction,
                            *rest, **kwargs)
        from megatron.core.utils import get_model_config
        from megatron.rl import rl_utils

        plan_settings = settings()
        vpp = plan_settings.parallel.vpp_size
        chunks = STATE.model_chunks if vpp > 1 else [model]
        if vpp > 1 and (not chunks or chunks[0] is not model and _unwrap(chunks[0]) is not _unwrap(model)):
            raise RuntimeError("slime-ext: the log-prob pass got a model that is not the training model's first "
                               "chunk; the VPP chunks are unknown")
        collection.logprob_passes += 1
        reference = collection.logprob_passes == 2
        if plan_settings.parallel.pp_size > 1:
            get_model_config(model).variable_seq_lengths = True
        last = _is_last_pp_rank(pp_group)
        out = torch.zeros(len(collection.bins), seq_length - 1, dtype=dtype, device=_device())
        step_fn = in_chunk(partial(rl_utils.logprobs_forward_step, is_correction=is_correction,
                                   packing_context=packing_context), vpp)
        extra = dict(adjust_tensor_shapes_fn=None)
        if "collect_non_loss_data" in kwargs:
            extra["collect_non_loss_data"] = kwargs["collect_non_loss_data"]
        # every micro-batch of every step, once, in the order the forward-only pipeline model predicts fastest
        ids = list(collection.plan.logprob_order[collection.dp_rank])
        with _reference_weights(chunks, reference):
            iterators = [iter([(torch.tensor([b]),) for b in ids]) for _ in chunks]
            outputs = forward_backward_func(
                forward_step_func=step_fn, data_iterator=iterators if vpp > 1 else iterators[0],
                model=chunks if vpp > 1 else model, num_microbatches=len(ids), seq_length=seq_length,
                micro_batch_size=1, decoder_seq_length=decoder_seq_length, forward_only=True,
                **_signature_kwargs(forward_backward_func, **extra))
        if last:
            if len(outputs) != len(ids):
                raise RuntimeError(f"slime-ext: the log-prob pass returned {len(outputs)} outputs for {len(ids)} "
                                   f"micro-batches")
            for b, output in zip(ids, outputs):
                n = collection.bin_tokens[b] - 1
                out[b, :n] = output.detach().reshape(-1)[:n].to(dtype)
        if pp_group is not None and pp_group.size() > 1:
            torch.distributed.broadcast(out, src=torch.distributed.get_global_rank(pp_group, pp_group.size() - 1),
                                        group=pp_group)
        return out.cpu()

    return compute_logprobs_batch


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


# ------------------------------------------------------------------------------------------------ 3. loading
def make_load_packed_data_by_index(original: Callable) -> Callable:
    """Megatron-RL's ``load_packed_data_by_index`` cut to the micro-batch's own length (module docstring, 3)."""

    def load_packed_data_by_index(bin_idx, packing_context, logprobs_is_correction):
        data = original(bin_idx, packing_context, logprobs_is_correction)
        collection = collection_of(packing_context)
        if collection is None:
            return data
        collection.expect(int(bin_idx))
        n = collection.bin_tokens[int(bin_idx)]
        (tokens, advantages, old_logprobs, loss_mask, position_ids, ref_logprobs, inference_logprobs, seq_starts,
         seq_lengths, seq_indices, params) = data

        def cut(t, width):
            return None if t is None else t[..., :width]

        return (cut(tokens, n), advantages, cut(old_logprobs, n - 1), cut(loss_mask, n - 1), cut(position_ids, n),
                cut(ref_logprobs, n - 1), cut(inference_logprobs, n - 1), seq_starts, seq_lengths, seq_indices,
                params)

    return load_packed_data_by_index


# ------------------------------------------------------------------------------------------------ 4, 5. the loop's data
def make_update_microbatch_calculator(original: Callable) -> Callable:
    """Megatron-RL's ``update_microbatch_calculator``: with slime-ext's plan, step 0's count (module docstring, 4)."""

    def update_microbatch_calculator(*args, **kwargs):
        collection = current_collection()
        if collection is None:
            return original(*args, **kwargs)
        plan = collection.plan
        _set_num_microbatches(plan.num_microbatches[0], plan.dp_size)
        logger.info(f"slime-ext: the collection trains in {plan.num_steps} optimizer steps of "
                    f"{list(plan.samples_per_step)} samples, {list(plan.num_microbatches)} micro-batches per DP rank")
        return None

    return update_microbatch_calculator


def make_get_grpo_data_iterator(original: Callable) -> Callable:
    """Megatron-RL's ``get_grpo_data_iterator`` (module docstring, 5)."""

    def get_grpo_data_iterator(model, inference_model, optimizer, iteration, ref_state_dict, *args, **kwargs):
        plan_settings = settings()
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        STATE.model_chunks = chunks
        vpp = plan_settings.parallel.vpp_size
        if vpp > 1 and len(chunks) != vpp:
            raise RuntimeError(f"slime-ext: --virtual-pipeline-model-parallel-size {vpp} but the training model has "
                               f"{len(chunks)} chunks")
        if vpp > 1 and id(ref_state_dict) != STATE.reference_id:
            capture_reference(chunks, ref_state_dict)
        result = original(model, inference_model, optimizer, iteration, ref_state_dict, *args, **kwargs)
        collection = current_collection()
        if collection is not None and vpp > 1 and not isinstance(result, list):
            from megatron.core.rerun_state_machine import RerunDataIterator
            from megatron.rl import sequence_packing_utils as spu

            result = [result] + [RerunDataIterator(itertools.cycle(spu.get_microbatch_dataloader(len(collection.bins),
                                                                                               1)))
                                 for _ in chunks[1:]]
        return result

    return get_grpo_data_iterator


# ------------------------------------------------------------------------------------------------ 6. the step
def _megatron_lr_increment() -> int:
    """The increment Megatron-LM's ``train_step`` steps the LR scheduler by: micro-batches x micro-batch size x DP
    (x the GTP-remat peers, in the Megatron-LM that has them)."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.training import get_args

    args = get_args()
    return (nmc.get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
            * getattr(args, "gtp_weight_remat_size", 1))


def make_train_step(original: Callable) -> Callable:
    """megatron.training's ``train_step`` (module docstring, 6)."""

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, *args, **kwargs):
        collection = current_collection()
        if collection is None:
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, *args,
                            **kwargs)
        plan_settings = settings()
        plan = collection.plan
        step = collection.steps_done % collection.num_steps
        _set_num_microbatches(plan.num_microbatches[step], plan.dp_size)
        if plan_settings.parallel.pp_size > 1:
            config.variable_seq_lengths = True
        collection.current_step = step
        scheduler = opt_param_scheduler if opt_param_scheduler is None else StepSizedScheduler(
            opt_param_scheduler, expected=_megatron_lr_increment(), increment=plan.samples_per_step[step],
            expected_is="Megatron-LM's micro-batches x micro-batch size x DP")
        try:
            result = original(in_chunk(forward_step_func, plan_settings.parallel.vpp_size), data_iterator, model,
                              optimizer, scheduler, config, *args, **kwargs)
        finally:
            collection.current_step = None
        collection.steps_done += 1
        collection.last_step = step
        return result

    return train_step


def make_get_iteration_sequence_count(original: Callable) -> Callable:
    """Megatron-RL's ``get_iteration_sequence_count(args)``: the samples the last planned step trained."""

    def get_iteration_sequence_count(args):
        collection = current_collection()
        if collection is None or collection.last_step is None:
            return original(args)
        return int(collection.plan.samples_per_step[collection.last_step])

    return get_iteration_sequence_count


# ------------------------------------------------------------------------------------------------ 7. VPP stages
def make_is_pipeline_last_stage(original: Callable) -> Callable:
    """``parallel_state.is_pipeline_last_stage``: asked with its defaults inside a VPP chunk's forward step run by
    slime-ext, it answers for that chunk (``ignore_virtual=False, vp_stage=<chunk>``); otherwise as Megatron."""

    def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
        stage = getattr(_local, "stage", None)
        if stage is not None and ignore_virtual and vp_stage is None:
            return original(ignore_virtual=False, vp_stage=stage[0])
        return original(ignore_virtual=ignore_virtual, vp_stage=vp_stage)

    return is_pipeline_last_stage


def make_is_pp_last_stage(original: Callable) -> Callable:
    """``is_pp_last_stage(pp_group)`` as ``megatron.rl.rl_utils`` sees it: inside a VPP chunk's forward step run by
    slime-ext, true only for the last chunk of the last pipeline rank."""

    def is_pp_last_stage(pp_group):
        last = original(pp_group)
        stage = getattr(_local, "stage", None)
        if stage is None:
            return last
        return last and stage[0] == stage[1] - 1

    return is_pp_last_stage


def make_packing_compute_tokens(original: Callable) -> Callable:
    """Megatron-RL's ``get_packing_compute_tokens`` (throughput logs): the tokens slime-ext's micro-batches compute."""

    def get_packing_compute_tokens(packing_context):
        collection = collection_of(packing_context)
        return original(packing_context) if collection is None else int(sum(collection.bin_tokens))

    return get_packing_compute_tokens


def make_packing_efficiency(original: Callable) -> Callable:
    """Megatron-RL's ``get_packing_efficiency``: real tokens over computed tokens, over all DP ranks."""

    def get_packing_efficiency(packing_context):
        collection = collection_of(packing_context)
        if collection is None:
            return original(packing_context)
        plan = collection.plan
        computed = plan.computed_tokens()
        lengths = packing_context.packing_info.seq_lengths
        return plan.real_tokens(lengths) / computed if computed else 0.0

    return get_packing_efficiency
