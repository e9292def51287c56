"""What a worker rank records while Megatron-LM's ``train()`` runs, without changing what it does.

* The rollout source: ``rl_utils.get_environment_rollouts`` is the one function replaced (the inference engine);
  it returns :func:`mrl_rollouts.make_collection` in Megatron-RL's types and remembers the collection.
* ``training.train_step`` and ``rl_utils.get_grpo_data_iterator`` are wrapped by observers that call the original
  with the same arguments and return its result; around the call they note the phase (``train`` or ``logprobs``)
  and after it they read the optimizer, the scheduler, the parameters and Megatron-RL's packing context.
* A forward pre-hook on the first model chunk reads, for every micro-batch, the token row and ``PackedSeqParams``
  the model receives: which samples the row holds (identified by their tokens, :func:`synthetic_rollouts.
  sample_id_of`, and checked token for token), how many tokens are computed (padding included) and how many are
  real. That is path-independent: it sees what any packing hands the model.

Sample ids are global over the run: ``collection * samples_per_collection + index`` (index: the group-major
position in the collection, the order Megatron-RL flattens it in).
"""

from __future__ import annotations

import contextlib
import os

import torch

import mrl_rollouts

#: the format of the records; mrl_results.py reads it
FORMAT = "slime-ext/megatron-rl-worker/1"


class Recorder:
    def __init__(self, args, model, optimizer, scheduler, opts):
        from megatron.core import mpu
        from megatron.training import get_tokenizer

        self.args, self.model, self.optimizer, self.scheduler, self.opts = args, model, optimizer, scheduler, opts
        self.samples_per_collection = opts.prompts * opts.group_size
        self.eod, self.pad = get_tokenizer().eod, get_tokenizer().pad
        self.collections: list[list[mrl_rollouts.Sample]] = []  # flat, group-major, per collection
        self.steps: list[dict] = []
        self.logprobs: dict[int, dict] = {}  # collection -> {"old": {sid: tensor}, "ref": {...}}
        self.logprob_micro_batches: dict[int, list] = {}  # collection -> micro-batches of both passes, in order
        self.phase: tuple[str, object] | None = None
        from slime_ext.training.model import param_snapshot
        self.initial_params = param_snapshot(model)  # after the canonical initialisation, before train()
        self.rank = dict(rank=torch.distributed.get_rank(), dp_rank=mpu.get_data_parallel_rank(),
                         pp_rank=mpu.get_pipeline_model_parallel_rank(),
                         dp_size=mpu.get_data_parallel_world_size(),
                         pp_size=mpu.get_pipeline_model_parallel_world_size(),
                         vpp_size=len(model))

    # ------------------------------------------------------------------------------------------------ rollouts
    def install_rollout_source(self) -> None:
        """Replace Megatron-RL's inference engine (``get_environment_rollouts``) by the synthetic source."""
        from megatron.rl import rl_utils

        def get_environment_rollouts(model, inference_model, optimizer, n_prompts, samples_per_group):
            collection = len(self.collections)
            groups = mrl_rollouts.make_collection(self.opts.seed, collection, n_prompts, samples_per_group,
                                                        self.args.seq_length, self.eod, self.pad)
            self.collections.append([s for g in groups for s in g])
            return mrl_rollouts.to_megatron(groups, epoch=int(getattr(self.args, "curr_iteration", 0)))

        rl_utils.get_environment_rollouts = get_environment_rollouts

    def sample_id(self, collection: int, index: int) -> int:
        return collection * self.samples_per_collection + index

    # ------------------------------------------------------------------------------------------------ observers
    @contextlib.contextmanager
    def observing(self):
        from megatron.rl import rl_utils
        from megatron.training import training

        original_train_step, original_grpo = training.train_step, rl_utils.get_grpo_data_iterator

        def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *args, **kwargs):
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            if self.steps:
                self.steps[-1]["consumed_train_samples"] = int(self.args.consumed_train_samples)
            step = dict(iteration=kwargs.get("iteration"), collection=len(self.collections) - 1, micro_batches=[])
            self.phase = ("train", step["micro_batches"])
            try:
                out = original_train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                                          *args, **kwargs)
            finally:
                self.phase = None
            # read after the step: the count the schedule ran (slime-ext's path sets each step's count inside)
            step["num_microbatches"] = int(get_num_microbatches())
            step.update(self._after_step(out))
            self.steps.append(step)
            return out

        def get_grpo_data_iterator(*args, **kwargs):
            before = len(self.collections)
            micro_batches: list = []
            self.phase = ("logprobs", micro_batches)
            try:
                out = original_grpo(*args, **kwargs)
            finally:
                self.phase = None
            if len(self.collections) > before:  # a new collection: its data preparation ran now
                collection = len(self.collections) - 1
                self.logprob_micro_batches[collection] = micro_batches
                self.logprobs[collection] = self._unpack_logprobs(collection)
            return out

        hook = _unwrap(self.model[0]).register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        training.train_step, rl_utils.get_grpo_data_iterator = train_step, get_grpo_data_iterator
        try:
            yield
        finally:
            training.train_step, rl_utils.get_grpo_data_iterator = original_train_step, original_grpo
            hook.remove()

    def _pre_forward(self, module, args, kwargs):
        if self.phase is None:
            return None
        tokens = args[0] if args else kwargs.get("input_ids")
        packed = kwargs.get("packed_seq_params")
        self.phase[1].append(self.describe_micro_batch(tokens, packed))
        return None

    def describe_micro_batch(self, tokens: torch.Tensor, packed) -> dict:
        """Which samples a micro-batch row holds, its computed tokens (padding included) and its real tokens."""
        row = tokens.reshape(-1).tolist()
        segments = _segments(packed, len(row))
        collection = len(self.collections) - 1
        samples, unknown = [], []
        for start, length in segments:
            piece = row[start:start + length]
            try:
                index = mrl_rollouts.sample_id_of(piece)
            except ValueError:
                if any(t != self.pad for t in piece):
                    unknown.append((start, length))
                continue  # padding
            sample = self.collections[collection][index]
            if tuple(piece) != sample.tokens:
                unknown.append((start, length))
                continue
            samples.append(self.sample_id(collection, index))
        real = sum(self.collections[collection][s % self.samples_per_collection].length for s in samples)
        return dict(samples=samples, tokens=len(row), real_tokens=real, segments=segments, unknown=unknown)

    # ------------------------------------------------------------------------------------------------ after a step
    def _after_step(self, out) -> dict:
        from slime_ext.training.model import param_snapshot

        loss_dict, skipped_iter = out[0], out[1]
        grad_norm = out[5] if len(out) > 5 else None
        group = self.optimizer.param_groups[0]
        sched = self.scheduler
        return dict(
            lr=float(group["lr"]), lrs=sorted({float(g["lr"]) for g in self.optimizer.param_groups}),
            num_steps=int(sched.num_steps),
            skipped=int(skipped_iter),
            grad_norm=None if grad_norm is None else float(grad_norm),
            loss={k: _scalar(v) for k, v in (loss_dict or {}).items()},
            params=param_snapshot(self.model),
        )

    def schedule_info(self) -> dict:
        s = self.scheduler
        return {k: getattr(s, k, None) for k in ("max_lr", "min_lr", "init_lr", "lr_warmup_steps", "lr_decay_steps",
                                                  "lr_decay_style", "num_steps")}

    def lr_at(self, num_steps: int) -> float:
        """Megatron's own schedule (``OptimizerParamScheduler.get_lr``) evaluated at ``num_steps`` samples."""
        s = self.scheduler
        saved = s.num_steps
        s.num_steps = num_steps
        try:
            group = self.optimizer.param_groups[0]
            try:
                return float(s.get_lr(group))
            except TypeError:  # older signature without the group
                return float(s.get_lr())
        finally:
            s.num_steps = saved

    # ------------------------------------------------------------------------------------------------ log-probs
    def _unpack_logprobs(self, collection: int) -> dict:
        """``{"old": {sample id: vector}, "ref": {...}}`` for the samples of this rank's bins, read from Megatron-RL's
        packing context with its own ``load_packed_data_by_index``: sample ``i`` at ``[start, start + L)`` of a bin
        has the ``L - 1`` next-token log-probs at ``[start, start + L - 1)``.

        INTEGRATOR (``--path ext``): if slime-ext keeps its log-probs elsewhere than Megatron-RL's
        ``runtime_state.packing_context`` (``old_logprobs`` / ``ref_logprobs`` per bin, bins readable with
        ``load_packed_data_by_index``), read them here into the same ``{sid: vector of L - 1}`` form, so that
        ``mrl_results.max_logprob_diff`` compares the two paths sample by sample."""
        from megatron.rl import rl_utils
        from megatron.rl.sequence_packing_utils import load_packed_data_by_index
        from slime_ext.patches.megatron_cpu import cpu_device_context

        ctx = rl_utils.get_rl_runtime_state().packing_context
        out = {"old": {}, "ref": {}}
        if ctx is None:
            return out
        with cpu_device_context():
            for b in range(len(ctx.packed_trajs)):
                (tokens, _, old, _, _, ref, _, starts, lengths, _, _) = load_packed_data_by_index(b, ctx, False)
                row = tokens.reshape(-1).tolist()
                for start, length in zip(starts, lengths):
                    index = mrl_rollouts.sample_id_of(row[start:start + 2])
                    if tuple(row[start:start + length]) != self.collections[collection][index].tokens:
                        raise AssertionError(f"bin {b} at {start}: tokens are not those of sample {index}")
                    sid = self.sample_id(collection, index)
                    out["old"][sid] = old.reshape(-1)[start:start + length - 1].detach().float().clone()
                    out["ref"][sid] = ref.reshape(-1)[start:start + length - 1].detach().float().clone()
        return out

    # ------------------------------------------------------------------------------------------------ the record
    def finish(self, iteration: int) -> dict:
        import megatron.core.package_info as package_info

        if self.steps:
            self.steps[-1]["consumed_train_samples"] = int(self.args.consumed_train_samples)
        for step in self.steps:
            step["lr_schedule_at_num_steps"] = self.lr_at(step["num_steps"])
            step["lr_schedule_at_consumed_samples"] = self.lr_at(step["consumed_train_samples"])
        train_counts: dict[int, dict[int, int]] = {}
        for step in self.steps:
            counts = train_counts.setdefault(step["collection"], {})
            for mb in step["micro_batches"]:
                for sid in mb["samples"]:
                    counts[sid] = counts.get(sid, 0) + 1
        samples = {self.sample_id(c, s.index): dict(collection=c, index=s.index, group=s.group, length=s.length,
                                                      prompt_length=s.prompt_length)
                   for c, coll in enumerate(self.collections) for s in coll}
        return dict(
            format=FORMAT, **self.rank, iteration=int(iteration),
            megatron_version=package_info.__version__, megatron_lm_tree=_tree_commit(),
            args={k: getattr(self.args, k, None) for k in (
                "global_batch_size", "micro_batch_size", "seq_length", "grpo_prompts_per_step", "grpo_group_size",
                "grpo_iterations", "rl_sequence_packing_algo", "rl_sequence_packing_max_sequences_per_bin",
                "calculate_per_token_loss", "train_iters", "lr", "min_lr")},
            schedule=self.schedule_info(),
            samples=samples, initial_params=self.initial_params, steps=self.steps, logprobs=self.logprobs,
            logprob_micro_batches=self.logprob_micro_batches, train_counts=train_counts,
        )


def _tree_commit() -> dict:
    """The Megatron-LM tree that ran: its path and the commit ci/megatron_rl_test extracted it from (``.commit``)."""
    tree = os.environ.get("MEGATRON_LM_TREE", "")
    commit = None
    if tree and os.path.exists(os.path.join(tree, ".commit")):
        with open(os.path.join(tree, ".commit")) as f:
            commit = f.read().strip()
    return dict(path=tree, commit=commit)


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _scalar(value):
    if isinstance(value, torch.Tensor):
        return value.detach().float().reshape(-1).tolist()
    return value


def _segments(packed, total: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every segment ``PackedSeqParams`` lists (the whole row without it)."""
    if packed is None:
        return [(0, total)]
    cu = [int(x) for x in packed.cu_seqlens_q.tolist()]
    padded = getattr(packed, "cu_seqlens_q_padded", None)
    starts = [int(x) for x in padded.tolist()] if padded is not None else cu
    return [(starts[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1) if cu[i + 1] > cu[i]]
