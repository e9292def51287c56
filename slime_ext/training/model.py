"""The model: a Megatron ``GPTModel`` (local layer spec with THD core attention, fp32), one chunk per virtual pipeline
stage, DDP-wrapped.

The layer spec is megatron-core's local one with :class:`slime_ext.training.thd_attention.ThdDotProductAttention` as
its core attention (:func:`~slime_ext.training.thd_attention.get_thd_layer_spec`): micro-batches arrive packed as
THD (:mod:`.batch`) and attention runs within each sample, costing Σ L² per micro-batch as varlen kernels do on GPU.

Parameters are initialised from their **canonical names** -- the name a parameter has in a single-process model
(global layer numbers; the last stage's copy of tied embeddings is the embedding) -- each from its own seeded
generator. So every parallel layout starts from exactly the same weights as a single-process reference, which is
what lets the tests compare trained parameters across layouts.
"""

from __future__ import annotations

import math
import re
import zlib

import torch

from slime_ext.train_config import TrainConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def transformer_config(config: TrainConfig):
    """Megatron's ``TransformerConfig`` for this run (CPU-friendly: fp32, no fusions, variable sequence lengths)."""
    from megatron.core.transformer import TransformerConfig

    vpp = config.parallel.vpp_size
    return TransformerConfig(
        num_layers=config.model.num_layers,
        hidden_size=config.model.hidden_size,
        num_attention_heads=config.model.num_attention_heads,
        ffn_hidden_size=config.model.ffn_size,
        init_method_std=config.model.init_method_std,
        hidden_dropout=config.model.hidden_dropout,
        attention_dropout=config.model.attention_dropout,
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        pipeline_model_parallel_size=config.parallel.pp_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        microbatch_group_size_per_vp_stage=config.parallel.microbatch_group_size_per_vp_stage if vpp > 1 else None,
        # micro-batches are packed to their own length; under PP the stages exchange shapes first
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the allgather default refuses variable_seq_lengths (no MoE here)
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
        use_cpu_initialization=True,
        perform_initialization=False,  # init_canonical() below sets every parameter
        attention_softmax_in_fp32=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # sent activations must stay intact until a (CPU: asynchronous, see patches.megatron_cpu) send completes
        deallocate_pipeline_outputs=False,
    )


def build_model(config: TrainConfig, position_embedding_type: str = "learned_absolute") -> list:
    """One ``GPTModel`` per virtual pipeline stage of this rank (unwrapped), canonically initialised.
    ``position_embedding_type``: megatron-core's (``"rope"`` for a host that passes no position ids with packed
    sequences, as NeMo-RL does)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from .thd_attention import get_thd_layer_spec

    tconfig = transformer_config(config)
    spec = get_thd_layer_spec()
    vpp = config.parallel.vpp_size
    chunks = []
    for vp_stage in range(vpp):
        v = vp_stage if vpp > 1 else None
        chunks.append(GPTModel(
            config=tconfig,
            transformer_layer_spec=spec,
            vocab_size=config.model.vocab_size,
            max_sequence_length=config.model.max_positions,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
            share_embeddings_and_output_weights=not config.model.untie_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            vp_stage=v,
        ))
    if torch.cuda.is_available():  # built on the CPU (use_cpu_initialization), trained on this rank's GPU
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    init_canonical(chunks, config)
    return chunks


def wrap_ddp(chunks: list, config: TrainConfig) -> list:
    """Megatron DDP per chunk (gradients reduced in fp32 after the last micro-batch, averaged over DP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
        average_in_collective=False,  # gloo has no AVG: pre-scale by 1/dp and SUM
    )
    tconfig = chunks[0].config
    wrapped = [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    # what megatron's training loop wires up: grad all-reduce after the last micro-batch, and no_sync before it
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    tconfig.grad_scale_func = None
    return wrapped


def unwrap(chunk):
    """The ``GPTModel`` inside a DDP wrapper (or the chunk itself)."""
    return getattr(chunk, "module", chunk)


def canonical_named_parameters(chunks: list) -> list[tuple[str, torch.nn.Parameter]]:
    """``(canonical name, parameter)`` for every parameter of this rank's chunks.

    The canonical name is the single-process name: layer indices are global (``layer_number - 1``), and the
    output-layer copy that tied embeddings keep on the last pipeline stage is named after the embedding.
    """
    out = []
    for chunk in chunks:
        model = unwrap(chunk)
        layers = model.decoder.layers
        for name, param in model.named_parameters():
            m = _LAYER.match(name)
            if m:
                global_index = layers[int(m.group(1))].layer_number - 1
                name = f"decoder.layers.{global_index}." + name[m.end():]
            elif name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                name = "embedding.word_embeddings.weight"
            out.append((name, param))
    return out


def _seed_for(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_canonical(chunks: list, config: TrainConfig) -> None:
    """Set every parameter in place from its canonical name and ``config.seed``.

    Matrices: normal(0, ``init_method_std``), scaled by ``1/sqrt(2 * num_layers)`` for the two projections that
    feed the residual stream (Megatron's ``output_layer_init_method``); norm weights 1, biases 0.
    """
    scaled = config.model.init_method_std / math.sqrt(2.0 * config.model.num_layers)
    for name, param in canonical_named_parameters(chunks):
        if param.dim() >= 2:
            output_proj = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
            std = scaled if output_proj else config.model.init_method_std
            gen = torch.Generator().manual_seed(_seed_for(config.seed, name))
            param.copy_(torch.randn(tuple(param.shape), generator=gen, dtype=torch.float32) * std)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.fill_(1.0)


def param_snapshot(chunks: list) -> dict[str, torch.Tensor]:
    """Canonical name -> flattened fp32 copy of this rank's parameters (a tied weight appears once per copy)."""
    snap: dict[str, torch.Tensor] = {}
    for name, param in canonical_named_parameters(chunks):
        value = param.detach().float().reshape(-1).cpu().clone()
        if name in snap and not torch.equal(snap[name], value):
            raise RuntimeError(f"two copies of {name} on one rank differ")
        snap[name] = value
    return snap
