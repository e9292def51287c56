"""Core attention over THD packed sequences without TransformerEngine: causal within each sample, Σ L² per row.

slime (v0.3.1, HEAD) and this repo's training adapter pack a micro-batch as THD: the samples' tokens concatenated
into one row ``[1, T]`` and ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=..., cu_seqlens_kv=...)`` saying where
each sample starts. megatron-core's local ``DotProductAttention`` refuses ``packed_seq_params``; TransformerEngine's
attention takes it, but needs CUDA and TE. :class:`ThdDotProductAttention` takes it anywhere torch runs::

    for each sample [s, e) of cu_seqlens:                        # one SDPA call per sample: cost Σ L², not T²
        out[s:e] = softmax(q[s:e] k[s:e]^T * scale + causal) v[s:e]   # GQA: each query group's K/V serve its heads

What the rest of the layer already does, and this module does not repeat (megatron-core 0.16-0.19, ``Attention``
in ``transformer/attention.py``): with ``qkv_format == "thd"`` it squeezes Q/K/V to ``[t, heads, head_dim]``, applies
rotary embeddings per sample (``apply_rotary_pos_emb(..., cu_seqlens=...)`` -> ``_apply_rotary_pos_emb_thd``: every
sample's positions start at 0, from a table of ``max(max_seqlen_q, max_seqlen_kv)`` positions; the unfused path, so
keep ``apply_rope_fusion=False``, TE's fused THD kernel is the only other one), and reshapes the output back to
``[t, 1, heads * head_dim]``. So only the core attention needs replacing, which a layer spec does
(:func:`get_thd_layer_spec`); Megatron's classes stay as they are.

Layouts accepted (``forward``):

* THD: ``query [t, np, hn]``, ``key``/``value`` ``[t, ng, hn]``, ``packed_seq_params.qkv_format == "thd"``.
  ``cu_seqlens_q`` must equal ``cu_seqlens_kv`` (self-attention). With ``cu_seqlens_*_padded`` a sample occupies
  ``[padded[i], padded[i+1])`` and only its first ``cu_seqlens[i+1] - cu_seqlens[i]`` tokens are real: the padding
  rows attend to nothing and get 0 (as do rows past the last segment). slime pads the row's tail as one more
  "sample" in ``cu_seqlens``, which this handles like any other sample.
* SBHD (no ``packed_seq_params``): ``query [s, b, np, hn]``; causal when ``attn_mask_type`` is causal and no mask is
  given, else the given boolean mask (True = masked, as Megatron's). Returns ``[s, b, np * hn]``.

Not supported (an error says so): context parallelism > 1, ``attention_bias``, ``qkv_format`` other than ``thd``
with ``packed_seq_params``. ``attention_dropout`` is applied by SDPA with torch's default generator (Megatron's
local path forks the CUDA RNG tracker), so with dropout on, the masks differ from Megatron's; numerics are equal
with dropout 0, which is what :mod:`tests.unit.test_thd_attention` checks against ``DotProductAttention``.

For slime: ``--spec slime_ext.training.thd_attention slime_layer_spec`` (:func:`slime_layer_spec`, the
``(args, config, vp_stage) -> layer spec`` callable slime's ``model_provider`` calls).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import threading
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def thd_segments(packed_seq_params: Any, total_tokens: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every sample's real tokens in the packed row, from ``packed_seq_params``.

    Raises ``ValueError`` when the Q and KV segments differ, when they are not increasing, or when they overrun the
    row's ``total_tokens``.
    """
    def as_list(name: str) -> list[int] | None:
        value = getattr(packed_seq_params, name, None)
        return None if value is None else [int(x) for x in value.tolist()]

    cu_q, cu_kv = as_list("cu_seqlens_q"), as_list("cu_seqlens_kv")
    pad_q, pad_kv = as_list("cu_seqlens_q_padded"), as_list("cu_seqlens_kv_padded")
    if cu_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None; THD attention needs the samples' cumulative lengths")
    if (cu_kv is not None and cu_kv != cu_q) or pad_kv != pad_q:
        raise ValueError(f"cu_seqlens_q {cu_q} != cu_seqlens_kv {cu_kv} (or their _padded forms differ); "
                         f"ThdDotProductAttention is causal self-attention over the same samples")
    starts = pad_q if pad_q is not None else cu_q
    if len(starts) != len(cu_q) or cu_q[0] != 0 or starts[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and cu_seqlens_q_padded have as many entries "
                         f"(cu_seqlens_q={cu_q}, cu_seqlens_q_padded={pad_q})")
    segments = []
    for i in range(len(cu_q) - 1):
        length, room = cu_q[i + 1] - cu_q[i], starts[i + 1] - starts[i]
        if length < 0 or room < length:
            raise ValueError(f"sample {i}: cu_seqlens give length {length} in a slot of {room} tokens "
                             f"(cu_seqlens_q={cu_q}, cu_seqlens_q_padded={pad_q}); they must be non-decreasing")
        segments.append((starts[i], length))
    if starts[-1] > total_tokens:
        raise ValueError(f"cu_seqlens end at {starts[-1]} but the packed row has {total_tokens} tokens")
    return segments


class _LastSegments(threading.local):
    """The segments of the last ``cu_seqlens`` tensors read, per thread.

    Every layer of one forward pass gets the same ``PackedSeqParams``, and reading ``cu_seqlens`` to the host
    (``tolist``) waits for the GPU; with this, one wait per micro-batch instead of one per layer. A hit needs the
    very same tensor objects (held here, so their ids cannot be reused) at the same version (an in-place change
    bumps ``_version``) and the same row length.
    """

    tensors: tuple = ()
    key: tuple = ()
    segments: list = []

    def get(self, packed_seq_params: Any, total_tokens: int) -> list[tuple[int, int]]:
        tensors = tuple(getattr(packed_seq_params, name, None) for name in
                        ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"))
        key = (total_tokens, *(None if t is None else t._version for t in tensors))
        if len(tensors) == len(self.tensors) and all(a is b for a, b in zip(tensors, self.tensors)) \
                and key == self.key:
            return self.segments
        segments = thd_segments(packed_seq_params, total_tokens)
        self.tensors, self.key, self.segments = tensors, key, segments
        return segments


_last_segments = _LastSegments()


class ThdDotProductAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's ``SelfAttention`` (see the module docstring).

    The constructor takes what ``Attention.__init__`` passes to its ``core_attention`` in megatron-core 0.16-0.19
    (``config, layer_number, attn_mask_type, attention_type, cp_comm_type, softmax_scale, pg_collection``) and
    ignores keywords it does not use, so newer call sites keep working.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, **_ignored):
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError(f"ThdDotProductAttention: context_parallel_size={config.context_parallel_size} is not "
                             f"supported; use TransformerEngine's attention for context parallelism")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    # ------------------------------------------------------------------ one attention call
    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """``q [b, np, s, hn]``, ``k``/``v`` ``[b, ng, s, hn]`` -> ``[b, np, s, hn]``."""
        heads, groups = q.size(1), k.size(1)
        if heads != groups:
            if heads % groups:
                raise ValueError(f"{heads} query heads are not a multiple of {groups} key/value groups")
            # query head h reads group h // (heads / groups), as Megatron's repeat_interleave on the head dim
            k = k.repeat_interleave(heads // groups, dim=1)
            v = v.repeat_interleave(heads // groups, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                              is_causal=causal and mask is None, scale=self.softmax_scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("ThdDotProductAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if packed_seq_params is None:
            return self._forward_sbhd(query, key, value, attention_mask, causal)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only 'thd' is supported")
        if query.dim() != 3:
            raise ValueError(f"THD query must be [t, heads, head_dim] (megatron-core squeezes the batch dim), got "
                             f"{tuple(query.shape)}")
        total = query.size(0)
        # the row cut into samples and padding; torch.split, not one slice per sample: a slice's backward writes a
        # full-row zero tensor per sample (samples x T), split's backward is one concatenation (T)
        sizes, is_sample, cursor = [], [], 0
        for start, length in _last_segments.get(packed_seq_params, total):
            if start > cursor:  # padding between slots: attends to nothing
                sizes.append(start - cursor)
                is_sample.append(False)
            if length:
                sizes.append(length)
                is_sample.append(True)
            cursor = start + length
        if cursor < total:
            sizes.append(total - cursor)
            is_sample.append(False)
        pieces = []
        for sample, q, k, v in zip(is_sample, *(torch.split(x, sizes) for x in (query, key, value))):
            if sample:  # [L, heads, hn] -> [1, heads, L, hn] and back
                q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                pieces.append(self._sdpa(q, k, v, causal=causal)[0].transpose(0, 1))
            else:
                pieces.append(q.new_zeros(q.size(0), q.size(1), value.size(-1)))
        out = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        return out.reshape(total, -1)

    def _forward_sbhd(self, query, key, value, attention_mask, causal: bool) -> torch.Tensor:
        s, b = query.size(0), query.size(1)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        mask = None if attention_mask is None else ~attention_mask.to(torch.bool)  # Megatron: True = masked
        out = self._sdpa(q, k, v, causal=causal, mask=mask)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


# ---------------------------------------------------------------------------------------------------- layer specs
def with_thd_core_attention(spec):
    """A copy of a GPT layer spec (a ``ModuleSpec`` of a ``TransformerLayer``) or a decoder block spec (with
    ``layer_specs``) whose self-attention uses :class:`ThdDotProductAttention`; the input is not modified."""
    layer_specs = getattr(spec, "layer_specs", None)
    if layer_specs is not None:  # TransformerBlockSubmodules (MoE / heterogeneous layers)
        return dataclasses.replace(spec, layer_specs=[with_thd_core_attention(s) for s in layer_specs])
    attention = spec.submodules.self_attention
    if not hasattr(attention, "submodules") or not hasattr(attention.submodules, "core_attention"):
        raise ValueError(f"layer spec {spec} has no self_attention.submodules.core_attention to replace")
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=ThdDotProductAttention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def _local_spec_kwargs(fn, **wanted) -> dict:
    """The keywords ``fn`` accepts out of ``wanted`` (``moe_use_legacy_grouped_gemm`` is gone in megatron-core 0.19)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


def get_thd_layer_spec(**local_spec_kwargs):
    """``get_gpt_layer_local_spec(**local_spec_kwargs)`` with :class:`ThdDotProductAttention` as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return with_thd_core_attention(get_gpt_layer_local_spec(**_local_spec_kwargs(get_gpt_layer_local_spec,
                                                                                 **local_spec_kwargs)))


def slime_layer_spec(args, config, vp_stage=None):
    """slime's ``--spec`` callable: what slime's ``model_provider`` builds without TE, with THD core attention.

    ``--spec slime_ext.training.thd_attention slime_layer_spec`` (Megatron's ``--spec`` takes module and name).
    Dense models get :func:`get_thd_layer_spec` with slime's arguments; MoE models (``--num-experts``) get
    ``get_gpt_decoder_block_spec(config, use_transformer_engine=False)`` with every layer's core attention replaced.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if getattr(args, "num_experts", None):
        kwargs = {"use_transformer_engine": False}
        if vp_stage is not None and "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters:
            kwargs["vp_stage"] = vp_stage
        return with_thd_core_attention(get_gpt_decoder_block_spec(config, **kwargs))
    return get_thd_layer_spec(
        num_experts=getattr(args, "num_experts", None),
        moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        multi_latent_attention=getattr(args, "multi_latent_attention", False),
        moe_use_legacy_grouped_gemm=getattr(args, "moe_use_legacy_grouped_gemm", False),
    )
