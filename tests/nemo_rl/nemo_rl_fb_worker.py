"""One rank of NeMo-RL's Megatron training step on CPU over gloo: ``python nemo_rl_fb_worker.py RANK WORLD PORT PP OUT``.

For each mode (``nemo-rl``: NeMo-RL's own sharding; ``slime-ext``: the switch on, whose workers under PP run each
packed micro-batch at its own length; ``slime-ext-pad``: the switch with its ``pad_to_longest`` opt-out, NeMo-RL's
workers and their pad to the longest), from the same canonical weights:
the driver's real ``Policy._shard_for_train`` (every rank computes the same shards, as NeMo-RL's driver would send
them), then on this rank NeMo-RL's real worker path for its shard: ``process_global_batch`` (the global valid-token
counts, all-reduced over DP), ``get_microbatch_iterator`` (packing; under PP the pad to the longest),
``LossPostProcessor`` with its ``NLLLossFn``, and ``megatron_forward_backward`` over a tiny megatron-core GPT
(:mod:`slime_ext.training.model`: local layer spec with THD attention, fp32, DDP); then the log-prob pass: the
driver's real ``Policy._shard_for_logprob``, NeMo-RL's forward-only worker pass over this rank's shard
(:func:`logprob_pass`), gathered over DP and put back in order by NeMo-RL's ``reorder_data``. Writes the step's loss
(summed over micro-batches and DP ranks), every parameter's gradient by canonical name and the log-probs to ``OUT``.

CPU stand-ins: :mod:`slime_ext.patches.megatron_cpu` (megatron-core's CUDA calls) and its ``cpu_device_context``
around NeMo-RL's worker calls (``.cuda()`` and ``.to("cuda")`` become the identity), and the modules
:mod:`nemo_rl_stubs` lists.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.environ["NEMO_RL_TREE"], HERE]

import nemo_rl_stubs  # noqa: E402

nemo_rl_stubs.install()

import torch  # noqa: E402

GLOBAL_BATCH = 16
#: NeMo-RL's own sharding; slime-ext's (under PP its worker class's two parts: the worker patch, no pad to the
#: longest packed micro-batch, and megatron-core's variable_seq_lengths); slime-ext's with the pad_to_longest opt-out
#: (PP only: NeMo-RL's worker and its pad)
MODES = ("nemo-rl", "slime-ext", "slime-ext-pad")


def train_config(pp: int):
    from slime_ext.schedule import ParallelConfig
    from slime_ext.train_config import ModelConfig, TrainConfig

    return TrainConfig(parallel=ParallelConfig(dp_size=None, pp_size=pp),
                       model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128,
                                         seq_length=128),
                       dist_backend="gloo", dist_timeout_seconds=300.0)


def one_step(mode: str, config, cfg: dict, data) -> dict:
    from megatron.core import parallel_state
    from nemo_rl.algorithms.loss.loss_functions import NLLLossFn
    from nemo_rl.models.megatron.data import get_microbatch_iterator, process_global_batch
    from nemo_rl.models.megatron.train import LossPostProcessor, megatron_forward_backward

    from nemo_rl_fixtures import make_policy
    from slime_ext.integrations import nemo_rl as integration
    from slime_ext.integrations.nemo_rl import runtime
    from slime_ext.integrations.nemo_rl.worker import use_variable_seq_lengths
    from slime_ext.patches.megatron_cpu import cpu_device_context
    from slime_ext.training.model import build_model, canonical_named_parameters, wrap_ddp

    unpadded = mode == "slime-ext" and cfg["megatron_cfg"]["pipeline_model_parallel_size"] > 1
    if mode != "nemo-rl":
        integration.enable(pad_to_longest=mode == "slime-ext-pad")
    try:
        shards = make_policy(cfg, 2)._shard_for_train(data, GLOBAL_BATCH)
    finally:
        integration.disable()
    if unpadded:
        integration.enable_worker()
    dp_rank, dp_group = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_group()
    chunks = build_model(config, position_embedding_type="rope")
    model = wrap_ddp(chunks, config)
    if unpadded:
        use_variable_seq_lengths(model)
    loss_fn = NLLLossFn()
    widths = []

    def recorded(iterator):
        for processed in iterator:
            widths.append(int(processed.input_ids_cp_sharded.shape[-1]))
            yield processed

    if mode != "nemo-rl":
        integration.enable(pad_to_longest=mode == "slime-ext-pad")
    try:
        logprob_shards, sorted_indices = make_policy(cfg, 2)._shard_for_logprob(data)
        choice = runtime.STATE.last_choice if mode != "nemo-rl" else None
    finally:
        integration.disable()
    if unpadded:
        integration.enable_worker()
    try:
        with cpu_device_context():
            gb = process_global_batch(shards[dp_rank], loss_fn, dp_group, batch_idx=0, batch_size=GLOBAL_BATCH // 2)
            iterator, count, mbs, _, padded = get_microbatch_iterator(gb["batch"], cfg, 1, straggler_timer=None)
            post = LossPostProcessor(loss_fn=loss_fn, cfg=cfg, num_microbatches=count)
            metrics = megatron_forward_backward(model[0] if len(model) == 1 else model, recorded(iterator), count,
                                                padded, mbs, post, global_valid_seqs=gb["global_valid_seqs"],
                                                global_valid_toks=gb["global_valid_toks"])
            logprobs = logprob_pass(model[0] if len(model) == 1 else model, logprob_shards[dp_rank], cfg)
    finally:
        integration.disable()
    loss = torch.tensor([sum(float(m["loss"]) for m in metrics or [])], dtype=torch.float64)
    torch.distributed.all_reduce(loss, group=dp_group)
    grads = {name: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().clone()
             for name, p in canonical_named_parameters(chunks)}
    gathered = [None] * parallel_state.get_data_parallel_world_size()
    torch.distributed.all_gather_object(gathered, logprobs, group=dp_group)
    if gathered[0] is not None:  # the last stage: the workers' outputs as the driver gathers and reorders them
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        outputs = BatchedDataDict.from_batches([{"logprobs": lp} for lp in gathered])
        if sorted_indices is not None:
            outputs.reorder_data(sorted_indices)
        # a row's positions past its length are padding (a packed micro-batch's tail padding lands in its last
        # row): NeMo-RL's loss masks them, so only the real positions are compared
        real = torch.arange(outputs["logprobs"].shape[1])[None, :] < data["input_lengths"][:, None]
        logprobs = outputs["logprobs"] * real
    moved = sorted_indices is not None and list(sorted_indices) != sorted(sorted_indices)
    return {"loss": float(loss.item()), "grads": grads, "logprobs": logprobs, "rows_moved": moved,
            "nemo_rls_own_ran": bool(choice is not None and choice.theirs_wins), "num_microbatches": int(count),
            "last_stage": parallel_state.is_pipeline_last_stage(), "widths": widths,
            "packed": [int(t) for t in shards[dp_rank].micro_batch_lengths[0]]}


def logprob_pass(model, shard, cfg: dict):
    """NeMo-RL's worker-side log-prob pass over one shard (its iterator, ``LogprobsPostProcessor`` and a forward-only
    ``megatron_forward_backward``); on the last stage the rows' log-probs, each right-padded to the batch width,
    else ``None``."""
    from megatron.core import parallel_state
    from nemo_rl.models.megatron.data import get_microbatch_iterator
    from nemo_rl.models.megatron.train import LogprobsPostProcessor, megatron_forward_backward

    with torch.no_grad():
        iterator, count, mbs, width, padded = get_microbatch_iterator(shard, cfg, 1, straggler_timer=None)
        outputs = megatron_forward_backward(model, iterator, count, padded, mbs, LogprobsPostProcessor(cfg=cfg),
                                            forward_only=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    rows = [out["logprobs"] for out in outputs]
    return torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for lp in rows]).detach()


def main(rank: int, world: int, port: int, pp: int, out: str) -> None:
    from slime_ext.patches import megatron_cpu
    from slime_ext.training.parallel import init_parallel, shutdown_parallel

    from nemo_rl_fixtures import policy_config, rollouts

    megatron_cpu.apply_if_no_gpu()
    config = train_config(pp)
    init_parallel(config, rank, world, "127.0.0.1", port, store_hosted=True)
    cfg = policy_config(pp)
    cfg["sequence_packing"]["train_mb_tokens"] = 96
    data, _ = rollouts(GLOBAL_BATCH, seed=9, longest=60)
    try:
        torch.save({mode: one_step(mode, config, cfg, data) for mode in MODES if pp > 1 or mode != "slime-ext-pad"},
                   out)
    finally:
        shutdown_parallel()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
