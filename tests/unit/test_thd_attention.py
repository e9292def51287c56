"""THD core attention (``slime_ext.training.thd_attention``) against megatron-core's local ``DotProductAttention``.

The reference is Megatron's own class, run on each sample alone (``[s, b=1, heads, dim]``, an explicit causal mask);
ours runs once on the packed row with ``PackedSeqParams(qkv_format="thd")``. fp32 throughout; equal means within
``RTOL``/``ATOL`` (SDPA and Megatron's bmm + softmax sum in different orders, nothing more).

Two levels:

* the core attention alone, forward and input gradients, with GQA (8 query heads over 2 groups), several samples
  of different lengths, slime's padded tail segment, and ``cu_seqlens_q_padded`` slots;
* a whole ``GPTModel`` with rotary embeddings (``position_embedding_type="rope"``) and GQA: the THD spec on the
  packed row versus the local spec on every sample alone -- logits and every parameter's gradient. Megatron
  applies RoPE per sample itself from ``cu_seqlens`` (``_apply_rotary_pos_emb_thd``); this checks that the THD
  layer spec gets exactly the per-sample positions.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

RTOL, ATOL = 1e-5, 1e-6
GRAD_RTOL = 1e-5  # whole-model parameter gradients, relative to each tensor's largest element


@pytest.fixture(scope="module")
def megatron_world():
    """One process, gloo, Megatron's model-parallel groups (tp = pp = cp = 1), the CPU patches when no GPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from slime_ext.patches import megatron_cpu

    # a group an earlier test left in this process is used when it is this one-process world (never skipped on),
    # refused when it is another; only what this fixture creates is torn down
    own_group = not dist.is_initialized()
    if not own_group:
        assert dist.get_world_size() == 1, f"a {dist.get_world_size()}-process group is left in this test process"
    own_model_parallel = not parallel_state.model_parallel_is_initialized()
    if not own_model_parallel:
        sizes = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size())
        assert sizes == (1, 1), f"Megatron's model-parallel groups left in this process have (tp, pp) = {sizes}"
    patched = megatron_cpu.apply_if_no_gpu()
    if own_group:  # one process: it serves its own store on a port the OS gives it (port 0)
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    if own_model_parallel:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    # megatron-core allocates on torch.cuda.current_device() (DotProductAttention's buffer); on CPU the patches'
    # device context answers for it, as it does inside the training schedules
    context = megatron_cpu.cpu_device_context() if patched else contextlib.nullcontext()
    try:
        with context:
            yield
    finally:
        if own_model_parallel:
            parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()
        if patched:
            megatron_cpu.undo()


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=128,
                hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, bf16=False, fp16=False,
                use_cpu_initialization=True, attention_softmax_in_fp32=True, masked_softmax_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                persist_layer_norm=False, apply_rope_fusion=False)
    return TransformerConfig(**{**base, **overrides})


def _causal(length: int) -> "torch.Tensor":
    return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]


def _packed(lengths, padded=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                  max_seqlen_kv=max(lengths))
    if padded is not None:
        cp = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
        kwargs.update(cu_seqlens_q_padded=cp, cu_seqlens_kv_padded=cp)
    return PackedSeqParams(**kwargs)


@pytest.mark.parametrize("lengths,padded", [
    ([5, 17, 1, 33, 9], None),          # several samples, one of length 1
    ([12, 30, 6], [16, 32, 8]),         # cu_seqlens_q_padded: each sample in a slot with padding behind it
    ([40], None),                       # a single sample (Σ L² = T²)
])
def test_core_attention_equals_megatron_local_per_sample(megatron_world, lengths, padded):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from slime_ext.training.thd_attention import ThdDotProductAttention

    config = _config()
    heads, groups, dim = 8, 2, config.kv_channels
    ours = ThdDotProductAttention(config, layer_number=2, attn_mask_type=AttnMaskType.causal)
    ref = DotProductAttention(config, layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self")
    slots = padded or lengths
    total = sum(slots)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(total, heads, dim, generator=gen, requires_grad=True)
    k = torch.randn(total, groups, dim, generator=gen, requires_grad=True)
    v = torch.randn(total, groups, dim, generator=gen, requires_grad=True)
    out = ours(q, k, v, None, packed_seq_params=_packed(lengths, padded))
    assert out.shape == (total, heads * dim)
    grad_out = torch.randn(out.shape, generator=gen)
    (out * grad_out).sum().backward()

    start = 0
    for length, slot in zip(lengths, slots):
        sl = slice(start, start + length)
        qs, ks, vs = (x.detach()[sl].clone().requires_grad_(True) for x in (q, k, v))
        # Megatron's layout: [s, b, heads, dim]; output [s, b, heads * dim]
        ref_out = ref(qs[:, None], ks[:, None], vs[:, None], _causal(length), attn_mask_type=AttnMaskType.causal)
        ref_out = ref_out[:, 0]
        (ref_out * grad_out[sl]).sum().backward()
        torch.testing.assert_close(out[sl], ref_out, rtol=RTOL, atol=ATOL)
        for mine, theirs in ((q, qs), (k, ks), (v, vs)):
            torch.testing.assert_close(mine.grad[sl], theirs.grad, rtol=RTOL, atol=ATOL)
        # padding rows of the slot: no output, no gradient
        pad = slice(start + length, start + slot)
        assert torch.count_nonzero(out[pad]) == 0
        assert torch.count_nonzero(q.grad[pad]) == 0 and torch.count_nonzero(k.grad[pad]) == 0
        start += slot


def test_cu_seqlens_that_disagree_or_overrun_are_refused(megatron_world):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from slime_ext.training.thd_attention import ThdDotProductAttention

    config = _config()
    ours = ThdDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    q, kv = torch.zeros(10, 8, 8), torch.zeros(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    other = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=torch.tensor([0, 5, 10]),
                            max_seqlen_q=6, max_seqlen_kv=6)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        ours(q, kv, kv, None, packed_seq_params=other)
    overrun = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 12]),
                              cu_seqlens_kv=torch.tensor([0, 4, 12]), max_seqlen_q=8, max_seqlen_kv=8)
    with pytest.raises(ValueError, match="12 but the packed row has 10"):
        ours(q, kv, kv, None, packed_seq_params=overrun)


def _gpt(spec, config, seed: int = 0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=96, max_sequence_length=128,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 and "norm" in _ else 0.0))
    return model


def test_gpt_with_rope_and_gqa_thd_equals_local_spec_per_sample(megatron_world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slime_ext.training.thd_attention import ThdDotProductAttention, get_thd_layer_spec

    config = _config()
    spec = get_thd_layer_spec()
    assert spec.submodules.self_attention.submodules.core_attention is ThdDotProductAttention
    thd, local = _gpt(spec, config), _gpt(get_gpt_layer_local_spec(), config)
    names = [n for n, _ in thd.named_parameters()]
    assert names == [n for n, _ in local.named_parameters()]
    for (_, a), (_, b) in zip(thd.named_parameters(), local.named_parameters()):
        assert torch.equal(a, b)

    lengths = [7, 23, 2, 15]
    gen = torch.Generator().manual_seed(5)
    samples = [torch.randint(0, 96, (L,), generator=gen) for L in lengths]
    tokens = torch.cat(samples)[None]
    # positions restart per sample; RoPE takes them from cu_seqlens, position ids are only passed along
    positions = torch.cat([torch.arange(L) for L in lengths])[None]
    logits = thd(tokens, positions, None, packed_seq_params=_packed(lengths))  # [1, T, vocab]
    weights = torch.randn(logits.shape, generator=gen)
    (logits * weights).sum().backward()

    start = 0
    for L, toks in zip(lengths, samples):
        ref = local(toks[None], torch.arange(L)[None], _causal(L))
        torch.testing.assert_close(logits[:, start:start + L], ref, rtol=RTOL, atol=ATOL)
        (ref * weights[:, start:start + L]).sum().backward()  # gradients accumulate over the samples
        start += L
    for (name, a), (_, b) in zip(thd.named_parameters(), local.named_parameters()):
        # a gradient sums over every token of every sample, in another order on each side: judged against the
        # tensor's own scale (an element near 0 carries the absolute rounding of the large ones)
        err = float((a.grad - b.grad).abs().max() / b.grad.abs().max())
        assert err <= GRAD_RTOL, f"{name}: max |grad difference| / max |grad| = {err:.2e} > {GRAD_RTOL}"


def test_rope_positions_are_per_sample(megatron_world):
    """Guard for the test above: packing the same samples with one big cu_seqlens segment (positions running on
    across samples, attention across them) gives different logits -- so equality above is not vacuous."""
    from slime_ext.training.thd_attention import get_thd_layer_spec

    config = _config()
    model = _gpt(get_thd_layer_spec(), config)
    lengths = [9, 9]
    tokens = torch.randint(0, 96, (1, 18), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        apart = model(tokens, None, None, packed_seq_params=_packed(lengths))
        joined = model(tokens, None, None, packed_seq_params=_packed([18]))
    assert torch.allclose(apart[:, :9], joined[:, :9], rtol=RTOL, atol=ATOL)  # causal: the first sample agrees
    assert not torch.allclose(apart[:, 9:], joined[:, 9:], rtol=1e-3, atol=1e-3)


def test_slime_spec_callable(megatron_world):
    """slime's model_provider: ``import_module(args.spec)(args, config, vp_stage)`` -> a layer spec."""
    from types import SimpleNamespace

    from megatron.core.transformer.spec_utils import import_module

    from slime_ext.training.thd_attention import ThdDotProductAttention

    fn = import_module(["slime_ext.training.thd_attention", "slime_layer_spec"])
    args = SimpleNamespace(num_experts=None, moe_grouped_gemm=False, qk_layernorm=True, multi_latent_attention=False,
                           moe_use_legacy_grouped_gemm=False)
    spec = fn(args, _config(), None)
    assert spec.submodules.self_attention.submodules.core_attention is ThdDotProductAttention
    assert spec.submodules.self_attention.submodules.q_layernorm is not None


def test_segments_are_read_once_per_cu_seqlens_and_again_after_a_change(megatron_world, monkeypatch):
    """One host read of cu_seqlens per micro-batch (every layer gets the same tensors), none stale."""
    from megatron.core.transformer.enums import AttnMaskType

    from slime_ext.training import thd_attention

    reads = []
    real = thd_attention.thd_segments
    monkeypatch.setattr(thd_attention, "thd_segments", lambda p, t: reads.append(t) or real(p, t))
    ours = thd_attention.ThdDotProductAttention(_config(), layer_number=1, attn_mask_type=AttnMaskType.causal)
    q, kv = torch.randn(10, 8, 8), torch.randn(10, 2, 8)
    params = _packed([4, 6])
    first = ours(q, kv, kv, None, packed_seq_params=params)
    ours(q, kv, kv, None, packed_seq_params=params)  # a second layer, same micro-batch
    assert len(reads) == 1
    params.cu_seqlens_q[1] = 7  # changed in place (the same tensor object is cu_seqlens_kv)
    changed = ours(q, kv, kv, None, packed_seq_params=params)
    assert len(reads) == 2 and not torch.equal(first, changed)
    ours(q, kv, kv, None, packed_seq_params=_packed([4, 6]))  # equal values, new tensors: read again
    assert len(reads) == 3


def test_slime_spec_callable_for_moe_replaces_every_layers_core_attention(megatron_world):
    """``--num-experts``: slime builds ``get_gpt_decoder_block_spec``; every layer of the block gets THD attention."""
    from types import SimpleNamespace

    from slime_ext.training.thd_attention import ThdDotProductAttention, slime_layer_spec

    config = _config(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall")
    block = slime_layer_spec(SimpleNamespace(num_experts=4), config, None)
    assert len(block.layer_specs) == config.num_layers
    for layer in block.layer_specs:
        assert layer.submodules.self_attention.submodules.core_attention is ThdDotProductAttention
