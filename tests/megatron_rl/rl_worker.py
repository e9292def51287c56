"""One rank of Megatron-LM's own RL loop (``train_rl.py``, ``megatron/rl``) on CPU over gloo, recording what it did.

Run once per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), with a Megatron-LM tree first on
``PYTHONPATH`` (its ``megatron/core`` is the megatron-core under test; no wheel)::

    python tests/megatron_rl/rl_worker.py --path megatron --layout dp2pp2 --steps-per-collection 1 \\
        --iterations 2 --seed 1 --out result.pt

What is Megatron-LM's own code here, and what is not:

* **Megatron's own**: argument parsing and validation (``parse_args`` + ``validate_args`` with ``train_rl.py``'s
  extra arguments, ``set_global_variables``: the tokenizer too), the model (``train_rl._gpt_builder`` ->
  ``gpt_builders.gpt_builder`` through ``model_provider.model_provider``, ``--spec mrl_spec THD_LAYER_SPEC``),
  ``training.setup_model_and_optimizer`` (DDP, the plain Adam optimizer, the LR scheduler), and
  ``training.train()`` itself: its RL set-up (reference weights, the micro-batch calculator), and per iteration
  ``rl_utils.get_grpo_data_iterator`` (-> ``prepare_data_for_update``: group stats, trajectories, packing, the old
  and reference log-prob passes, ``update_microbatch_calculator``), ``training.train_step`` with
  ``train_rl.forward_step`` / ``loss_func``, the LR step and the ``consumed_train_samples`` bookkeeping.
* **Replaced**: only the inference engine. ``rl_utils.get_environment_rollouts`` returns a deterministic synthetic
  collection (:mod:`mrl_rollouts`) in Megatron-RL's own rollout types.
* **Done here instead of ``initialize_megatron``** (:func:`initialize`), because on a host without a GPU it skips
  the model-parallel set-up (``_initialize_distributed`` calls ``mpu.initialize_model_parallel`` only when
  ``torch.cuda.device_count() > 0``) and compiles the dataset C++ helpers: ``torch.distributed`` over gloo, the same
  ``mpu.initialize_model_parallel`` call, and ``_set_random_seed``'s seeding (Python/NumPy/torch from
  ``seed + 100 * pp_rank``, and megatron's RNG tracker, which ``slime_ext.patches.megatron_cpu`` keeps on the CPU).
  ``args.do_train/do_valid/do_test``, which ``build_train_valid_test_data_iterators`` sets in ``pretrain()``, are
  set to train-only (RL builds no dataset).
* **Differs from ``train_rl.py``'s own ``__main__``** in how the model is built at core_v0.19.0 and HEAD: there
  ``train_rl.py`` hands ``pretrain()`` a config container (``gpt_config_from_args``), and
  ``setup_model_and_optimizer`` builds through its ``GPTModelBuilder``; this worker passes the model provider
  instead (core_v0.16.1's way, still supported), which builds the same ``GPTModel`` from the same ``--spec``.
* **An fp32 adapter** (:func:`accept_fp32_output`): Megatron-RL's ``get_logprobs`` passes ``fp32_output=`` to the
  model, which only the bf16/fp16 wrapper accepts; a forward pre-hook drops it for the fp32 model.
* **Changed after set-up**: the initial weights. Every parameter is overwritten from its canonical name and the seed
  (:func:`slime_ext.training.model.init_canonical`), so DP2, DP2xPP2 and DP2xPP2xVPP2 start from the same model;
  ``train()`` then takes its reference weights from that model, as it does from a loaded checkpoint.
* **Observed, not changed**: ``training.train_step`` and ``rl_utils.get_grpo_data_iterator`` are wrapped by
  recorders that call the original unchanged and read state afterwards; a forward pre-hook on the first model
  chunk reads the token row and ``PackedSeqParams`` every micro-batch hands the model.
* On a host without CUDA, ``slime_ext.patches.megatron_cpu`` (megatron-core) and its Megatron-LM companion
  (:func:`slime_ext.patches.megatron_cpu.build_megatron_lm_patches`) run the CUDA-assuming calls on the CPU.

``--path ext`` calls ``slime_ext.integrations.megatron_rl.enable()`` before Megatron-RL's modules are used; until
that module exists the worker stops with a message saying so.

The result file (rank 0 writes it after a gather; see :mod:`mrl_results` for the format and the readers). On failure
every rank writes ``<out>.rank<r>.error.json`` with its traceback and exits with status 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # mrl_spec (for --spec), mrl_rollouts, mrl_results
    sys.path.insert(0, HERE)

LAYOUTS = {
    # name: (world size, pipeline stages, virtual stages per pipeline rank)
    "dp2": (2, 1, 1),
    "dp2pp2": (4, 2, 1),
    "dp2pp2vpp2": (4, 2, 2),
}
MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128,
             seq_length=128, init_method_std=0.02)
#: Megatron-RL treats a pad id of 0 as "no pad token" (``if not tokenizer.pad``), so pad and eod are the last two ids
PAD_ID, EOD_ID = MODEL["vocab_size"] - 2, MODEL["vocab_size"] - 1


def parse_cli(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--path", choices=("megatron", "ext"), required=True,
                   help="megatron: Megatron-RL's own packing; ext: slime-ext's (enable() before Megatron-RL runs)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True,
                   help="dp2 (world 2), dp2pp2 (world 4), dp2pp2vpp2 (world 4, 2 virtual stages per rank)")
    p.add_argument("--steps-per-collection", type=int, choices=(1, 4), default=1,
                   help="optimizer steps per rollout collection: global batch = prompts*group / this")
    p.add_argument("--iterations", type=int, default=2, help="optimizer steps (Megatron's --train-iters)")
    p.add_argument("--seed", type=int, default=1, help="model init, rollouts and Megatron's --seed")
    p.add_argument("--prompts", type=int, default=8, help="--grpo-prompts-per-step")
    p.add_argument("--group-size", type=int, default=4, help="--grpo-group-size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", required=True, help="result file (.pt), written by rank 0")
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="--path ext: slime-ext's token cap per micro-batch (enable(max_tokens_per_gpu=...))")
    p.add_argument("--no-per-token-loss", action="store_true",
                   help="leave out --calculate-per-token-loss (slime-ext refuses that; the test checks the refusal)")
    p.add_argument("--megatron-arg", action="append", default=[], metavar="ARG",
                   help="an extra Megatron-LM argument (repeat; '--megatron-arg=--flag')")
    opts = p.parse_args(argv)
    samples = opts.prompts * opts.group_size
    if samples % opts.steps_per_collection:
        p.error(f"--steps-per-collection {opts.steps_per_collection} does not divide {samples} samples per "
                f"collection (--prompts x --group-size)")
    return opts


def megatron_argv(opts, tokenizer_dir: str) -> list[str]:
    """The Megatron-LM command line of this run (what a ``train_rl.py`` user would pass)."""
    _, pp, vpp = LAYOUTS[opts.layout]
    samples = opts.prompts * opts.group_size
    m = MODEL
    argv = [
        # the tiny GPT: fp32, no dropout, megatron-core's local layers with slime-ext's THD core attention
        "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
        "--num-attention-heads", str(m["num_attention_heads"]), "--ffn-hidden-size", str(m["ffn_hidden_size"]),
        "--seq-length", str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]),
        "--position-embedding-type", "learned_absolute", "--init-method-std", str(m["init_method_std"]),
        "--attention-dropout", "0", "--hidden-dropout", "0",
        "--transformer-impl", "local", "--spec", "mrl_spec", "THD_LAYER_SPEC",
        "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir,
        "--vocab-size", str(m["vocab_size"]), "--make-vocab-size-divisible-by", "1",
        # parallelism
        "--pipeline-model-parallel-size", str(pp), "--distributed-backend", "gloo",
        # RL (GRPO) with Megatron-RL's sequence packing
        "--perform-rl-step", "--rl-use-sequence-packing",
        *([] if opts.no_per_token_loss else ["--calculate-per-token-loss"]),
        "--grpo-prompts-per-step", str(opts.prompts), "--grpo-group-size", str(opts.group_size),
        "--grpo-iterations", "1", "--global-batch-size", str(samples // opts.steps_per_collection),
        "--micro-batch-size", "1",
        # optimisation: a decaying LR so that "LR at N samples" is a real check
        "--train-iters", str(opts.iterations), "--lr", str(opts.lr), "--min-lr", str(opts.lr / 10),
        "--lr-decay-style", "linear", "--lr-decay-iters", str(max(opts.iterations, 1) * 2), "--optimizer", "adam",
        "--seed", str(opts.seed),
        # quiet: no evaluation, no checkpoints, no periodic logs
        "--eval-iters", "0", "--eval-interval", "1000000", "--log-interval", "1000000",
    ]
    if vpp > 1:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(m["num_layers"] // (pp * vpp))]
    return argv + list(opts.megatron_arg)


def make_tokenizer(directory: str) -> str:
    """A real Hugging Face tokenizer of ``vocab_size`` word-level tokens (``<pad>``, ``<eod>`` last), saved in
    ``directory`` for Megatron's ``--tokenizer-type HuggingFaceTokenizer``. (Megatron's ``NullTokenizer`` has no
    ``bos`` property, which Megatron-RL's ``prepare_trajectories`` reads.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eod>": EOD_ID}
    vocab.update({f"t{i}": i for i in range(MODEL["vocab_size"]) if i not in (PAD_ID, EOD_ID)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eod>").save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------------- set-up
def enable_ext_path(max_tokens_per_gpu: int | None = None) -> None:
    """``--path ext``: slime-ext's integration, switched on before Megatron-RL's modules are used."""
    try:
        from slime_ext.integrations import megatron_rl
    except ImportError as exc:
        raise SystemExit(f"--path ext: slime_ext.integrations.megatron_rl is not importable ({exc}); the "
                         f"integration does not exist on this branch yet, only --path megatron runs") from exc
    if not hasattr(megatron_rl, "enable"):
        raise SystemExit("--path ext: slime_ext.integrations.megatron_rl has no enable()")
    megatron_rl.enable(max_tokens_per_gpu=max_tokens_per_gpu)


def parse_megatron_args(argv: list[str]):
    """Megatron-LM's own parsing and validation, as ``train_rl.py`` runs it (with ``add_inference_args`` where the
    tree has it), then ``set_global_variables`` (tokenizer, timers, ...)."""
    from megatron.training import arguments
    from megatron.training.global_vars import set_global_variables

    try:
        from megatron.inference.utils import add_inference_args
    except ImportError:  # core_v0.16.1: train_rl.py passes no extra arguments
        add_inference_args = None
    saved = sys.argv
    sys.argv = [os.path.join(os.environ.get("MEGATRON_LM_TREE", ""), "train_rl.py"), *argv]
    try:
        if hasattr(arguments, "parse_and_validate_args"):  # core_v0.19.0 and later
            return arguments.parse_and_validate_args(extra_args_provider=add_inference_args, args_defaults={})
        args = arguments.parse_args(add_inference_args)
        arguments.validate_args(args, {})
        set_global_variables(args)
        return args
    finally:
        sys.argv = saved


def initialize(args) -> None:
    """What ``initialize_megatron`` does that this run needs (see the module docstring for why not it)."""
    import random

    import numpy as np
    import torch
    from megatron.core import mpu, tensor_parallel

    torch.distributed.init_process_group(backend="gloo", world_size=args.world_size, rank=args.rank)
    mpu.initialize_model_parallel(
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )
    seed = args.seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build(args):
    """``setup_model_and_optimizer`` with ``train_rl.py``'s model provider; then canonical initial weights."""
    import inspect

    import train_rl
    from megatron.core.enums import ModelType
    from megatron.training import training
    from model_provider import model_provider
    from slime_ext.training.model import init_canonical

    provider = functools.partial(model_provider, train_rl._gpt_builder)
    params = inspect.signature(training.setup_model_and_optimizer).parameters
    if "model_provider_func" in params and list(params)[0] == "model_type":  # core_v0.19.0 and later
        model, optimizer, scheduler = training.setup_model_and_optimizer(ModelType.encoder_or_decoder, provider,
                                                                         checkpointing_context={})
    else:
        model, optimizer, scheduler = training.setup_model_and_optimizer(provider, ModelType.encoder_or_decoder,
                                                                         checkpointing_context={})
    accept_fp32_output(model)
    canon = types.SimpleNamespace(seed=args.seed, model=types.SimpleNamespace(
        init_method_std=args.init_method_std, num_layers=args.num_layers))
    init_canonical(model, canon)
    return model, optimizer, scheduler


def accept_fp32_output(model) -> None:
    """Let an fp32 model take ``fp32_output=``, as Megatron-RL's ``get_logprobs`` passes it.

    ``rl_utils.get_logprobs`` (core_v0.16.1 to HEAD) calls ``model(..., fp32_output=not (args.fp16 or args.bf16))``,
    a keyword only ``Float16Module`` (the bf16/fp16 wrapper) takes: with fp32 weights the DDP wrapper holds the
    ``GPTModel`` directly, whose ``forward`` has no such parameter, and the first log-prob pass fails with
    ``TypeError: GPTModel.forward() got an unexpected keyword argument 'fp32_output'``. For an fp32 model the
    keyword means nothing (its outputs are fp32), so a forward pre-hook on each ``GPTModel`` drops it. Only
    where the model's ``forward`` lacks the parameter; the call is otherwise untouched.
    """
    import inspect

    def drop(module, args, kwargs):
        kwargs.pop("fp32_output", None)
        return args, kwargs

    for chunk in model:
        inner = chunk
        while hasattr(inner, "module"):
            inner = inner.module
        if "fp32_output" not in inspect.signature(inner.forward).parameters:
            inner.register_forward_pre_hook(drop, with_kwargs=True)


# ---------------------------------------------------------------------------------------------------- the run
def run(opts) -> dict:
    import torch

    from slime_ext.patches import megatron_cpu

    world, pp, vpp = LAYOUTS[opts.layout]
    if int(os.environ["WORLD_SIZE"]) != world:
        raise SystemExit(f"--layout {opts.layout} needs WORLD_SIZE={world}, got {os.environ['WORLD_SIZE']}")
    t0 = time.time()
    if opts.path == "ext":  # first: slime-ext's switch goes on before anything of Megatron-RL is used
        enable_ext_path(opts.max_tokens_per_gpu)
    megatron_cpu.apply_megatron_lm_if_no_gpu()  # megatron-core's and Megatron-LM's CUDA calls, on a CPU-only host
    tokenizer_dir = make_tokenizer(tempfile.mkdtemp(prefix="slime-ext-mrl-tok-"))
    args = parse_megatron_args(megatron_argv(opts, tokenizer_dir))
    initialize(args)
    import mrl_recorder  # after megatron is importable

    model, optimizer, scheduler = build(args)
    rec = mrl_recorder.Recorder(args, model, optimizer, scheduler, opts)
    rec.install_rollout_source()
    from megatron.core.utils import get_model_config
    from megatron.training import training
    import train_rl

    args.do_train, args.do_valid, args.do_test = True, False, False  # set by pretrain's data set-up
    t_setup = time.time() - t0
    with rec.observing():
        iteration, _flops = training.train(
            train_rl.forward_step, model, optimizer, scheduler,
            None, None, None,  # train/valid data iterators (RL makes its own), process_non_loss_data_func
            get_model_config(model[0]), {}, None,  # config, checkpointing_context, non_loss_data_func
        )
    result = rec.finish(iteration)
    result["timing"] = {"setup_s": t_setup, "train_s": time.time() - t0 - t_setup}
    return result


def main(argv=None) -> int:
    opts = parse_cli(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run(opts)
    except BaseException as exc:  # noqa: BLE001 -- every failure is written down, then re-raised as status 1
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        with open(f"{opts.out}.rank{rank}.error.json", "w") as f:
            json.dump({"rank": rank, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()}, f, indent=1)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait in torch.distributed's atexit for peers that may be stuck
    import torch

    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.gather_object(result, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        import mrl_results
        mrl_results.save(opts.out, gathered)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
