"""One process of the test of verl's real ``MegatronEngine.forward_backward_batch`` (tests/verl/test_engine.py).

    python tests/verl/engine_worker.py RANK WORLD INIT_FILE OUT_DIR PP [VPP]

verl builds its engine's model through Megatron-Bridge / mbridge from a HuggingFace checkpoint; this test instead
assembles a ``MegatronEngineWithLMHead`` around a tiny megatron-core GPT (rotary positions, slime-ext's THD core
attention for CPU) without calling its ``__init__``, setting the attributes its ``forward_backward_batch`` reads
(verl's own ``McoreEngineConfig`` defaults, an HF ``LlamaConfig`` for the forward-function lookup). Everything the
step runs is verl's: ``forward_backward_batch``, ``forward_step`` (verl's THD pre/post-processing and vocab-parallel
log-probs), ``postprocess_micro_batch_func`` (the loss scaling), ``postprocess_batch_func`` (outputs back in input
order), on megatron-core's pipeline schedule over gloo with slime-ext's CPU patches.

The same mini-batch is run twice on the same parameters: with verl's own ``prepare_micro_batches`` and with
slime-ext's (``enable()``). Per run: the micro-batches (a spy on the function the engine calls), the per-sample
log-probs the engine returns, and the gradients summed over the DP group. Pickled to ``OUT_DIR/rank{RANK}.pkl``.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

CAP = 96
VOCAB = 128
#: the torch.distributed collectives counted during each prepare_micro_batches call
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "gather")


def rank_lengths(dp_rank: int) -> list[tuple[int, int]]:
    """(prompt, response) per sample; long-tailed, different on each DP rank."""
    rng = np.random.default_rng(7 + dp_rank)
    total = np.clip(rng.lognormal(3.3, 0.7, size=10).astype(int), 6, CAP)
    return [(max(1, int(t) // 3), int(t) - max(1, int(t) // 3)) for t in total]  # responses of >= 2 tokens


def make_batch(dp_rank: int):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(100 + dp_rank)
    ids, masks = [], []
    for p, r in rank_lengths(dp_rank):
        ids.append(torch.randint(1, VOCAB, (p + r,), generator=g))
        # the log-prob at position t is of token t + 1 (verl rolls the labels over the packed row), so the last
        # position has no token of its own sample to predict: it is left out of the loss
        masks.append(torch.cat([torch.zeros(p, dtype=torch.int64), torch.ones(r - 1, dtype=torch.int64),
                                torch.zeros(1, dtype=torch.int64)]))
    n = len(ids)
    td = TensorDict({"input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
                     "loss_mask": torch.nested.as_nested_tensor(masks, layout=torch.jagged),
                     "temperature": torch.ones(n)}, batch_size=[n])
    tu.assign_non_tensor_data(td, "use_dynamic_bsz", True)
    tu.assign_non_tensor_data(td, "max_token_len_per_gpu", CAP)
    return td


def loss_function(model_output, data, dp_group=None):
    """Minus the log-likelihood of the response tokens, over the mini-batch's response tokens on all DP ranks (what
    verl's losses divide by): the gradient does not depend on how the mini-batch is cut into micro-batches."""
    from verl.utils import tensordict_utils as tu

    logp = model_output["log_probs"].values()
    mask = data["loss_mask"].values().to(logp.dtype)
    total = tu.get_non_tensor_data(data, key="batch_num_tokens", default=None)
    return -(logp * mask).sum() / total, {}


def build(pp: int, vpp: int):
    """One tiny GPT chunk per virtual pipeline stage of this rank, canonically initialised (the same parameters
    whatever the layout)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core import parallel_state as mpu

    from slime_ext.train_config import TrainConfig
    from slime_ext.training.model import init_canonical, transformer_config
    from slime_ext.training.thd_attention import get_thd_layer_spec

    config = TrainConfig.from_mapping(dict(num_layers=2 * vpp, hidden_size=32, num_attention_heads=4,
                                           vocab_size=VOCAB, seq_length=CAP, untie_embeddings_and_output_weights=True,
                                           pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp))
    tconfig = transformer_config(config)
    chunks = []
    for stage in range(vpp):
        v = stage if vpp > 1 else None
        chunks.append(GPTModel(config=tconfig, transformer_layer_spec=get_thd_layer_spec(), vocab_size=VOCAB,
                               max_sequence_length=CAP,
                               pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                               post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                               share_embeddings_and_output_weights=False, position_embedding_type="rope", vp_stage=v))
    init_canonical(chunks, config)
    return chunks, tconfig


def make_engine(chunks, tconfig):
    from transformers import LlamaConfig
    from verl.workers.config import McoreEngineConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     architectures=["LlamaForCausalLM"])
    engine.engine_config = McoreEngineConfig()
    engine.model_config = SimpleNamespace(hf_config=hf, mtp=SimpleNamespace(enable=False, enable_train=False),
                                          tokenizer=SimpleNamespace(pad_token_id=0), lora={})
    engine.tf_config = tconfig
    engine.module = chunks
    engine.is_value_model = False
    engine.enable_routing_replay = False
    engine.mini_layer_topk_idx_list = []
    return engine


def run_once(engine, chunks, data_fn, spy):
    from megatron.core import parallel_state as mpu

    named = sorted((f"{i}.{name}", p) for i, chunk in enumerate(chunks) for name, p in chunk.named_parameters())
    for _, p in named:
        p.grad = None
    spy.clear()
    out = engine.forward_backward_batch(data_fn(), loss_function, forward_only=False)
    grads = {}
    for name, p in named:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.detach().clone()
        dist.all_reduce(g, group=mpu.get_data_parallel_group())
        grads[name] = g
    logp = None
    if out:
        logp = [t.detach().clone() for t in out["model_output"]["log_probs"].unbind()]
    return {"grads": grads, "log_probs": logp, "calls": list(spy), "losses": out.get("loss") if out else None}


def main() -> None:
    rank, world, init_file, out_dir, pp = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                           int(sys.argv[5]))
    vpp = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import verl  # noqa: F401  (plugins load; the switch is off in this process's environment)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_platform

    cpu_platform.install()
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    import verl.workers.engine.megatron.transformer_impl as ti
    import slime_ext.integrations.verl as sv
    from slime_ext.patches import megatron_cpu

    megatron_cpu.apply_if_no_gpu()
    mpu.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    result = {"dp_rank": mpu.get_data_parallel_rank(), "pp_rank": mpu.get_pipeline_model_parallel_rank(),
              "dp_size": mpu.get_data_parallel_world_size(), "cap": CAP,
              "lengths": [p + r for p, r in rank_lengths(mpu.get_data_parallel_rank())]}
    try:
        chunks, tconfig = build(pp, vpp)
        engine = make_engine(chunks, tconfig)
        calls: list = []

        def spying(fn):
            def prepare(data, **kw):
                counted: dict[str, int] = {}
                saved = {name: getattr(dist, name) for name in COLLECTIVES}

                def counting(name):
                    def call(*args, **kwargs):
                        counted[name] = counted.get(name, 0) + 1
                        return saved[name](*args, **kwargs)
                    return call

                for name in COLLECTIVES:  # the collectives the call makes, by name
                    setattr(dist, name, counting(name))
                try:
                    mbs, idx = fn(data, **kw)
                finally:
                    for name, original in saved.items():
                        setattr(dist, name, original)
                calls.append({"indices": idx, "tokens": [int(mb["input_ids"].offsets()[-1]) for mb in mbs],
                              "collectives": counted})
                return mbs, idx
            return prepare

        dp_rank = mpu.get_data_parallel_rank()
        verl_own = ti.prepare_micro_batches
        ti.prepare_micro_batches = spying(verl_own)  # verl's own, behind a spy
        result["verl"] = run_once(engine, chunks, lambda: make_batch(dp_rank), calls)
        ti.prepare_micro_batches = verl_own  # the spy off again, so that the patch finds verl's function
        sv.enable()
        result["switched_on"] = bool(getattr(ti.prepare_micro_batches, "__slime_ext__", False))
        ti.prepare_micro_batches = spying(ti.prepare_micro_batches)
        result["ours"] = run_once(engine, chunks, lambda: make_batch(dp_rank), calls)
    except Exception:
        result["crash"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
