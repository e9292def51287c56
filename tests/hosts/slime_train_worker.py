"""Real slime training on CPU: slime's ``train`` / ``train_one_step`` (v0.2.4, v0.3.0, v0.3.1, HEAD) on the
Megatron-LM commit each tag pins, torch.distributed gloo, DP=2. Started by ``test_slime_train.py``; slime's tree and Megatron-LM first on PYTHONPATH.

Two phases, each in fresh processes (slime's modules and the patches are process-wide):

``prepare --case C --out DIR``
    One "driver" process with a real local Ray: the case's train data goes through slime's real
    ``RolloutManager._split_train_data_by_dp`` and ``process_rollout_data`` twice, first as slime ships it, then with
    ``slime_ext.integrations.slime.enable()`` (slime-ext plans on the rollout side), once per rollout of the case
    (``iterations``). Each rank's dict is saved to ``DIR/{path}-it{k}-rank{r}.pt``.
``train --case C --path slime|ext --out DIR``   (two processes, ``RANK``/``WORLD_SIZE``/``MASTER_*`` set)
    Megatron args parsed by slime's own parser (megatron's ``parse_args`` with slime's extra arguments, slime's
    defaults, megatron's ``validate_args``), slime's distributed/seed setup, slime's ``setup_model_and_optimizer``
    (megatron.training's ``get_model`` with slime's model provider, slime's LR scheduler), then the rank's rollout dict
    -> the actor's bound ``get_data_iterator`` -> slime's ``train`` (which calls ``train_one_step`` per step).
    ``--path ext`` first runs slime-ext's ``megatron_init`` hook, as slime's train actor does through
    ``--custom-megatron-init-path``. Writes ``DIR/{path}-result-rank{r}.pt``: parameters, scheduler state and
    what slime's ``loss_function`` was given.

What is not slime's own code here, and why (each is a CPU/test necessity, nothing is faked):

* slime-ext's CPU patches (``slime_ext.patches.megatron_cpu``) are applied, and slime's two CUDA-only calls outside
  Megatron's patched functions run inside its ``cpu_device_context``: ``get_model`` (``module.cuda()``, a CUDA
  side stream around the DDP wrap) and v0.2.4's ``get_data_iterator`` (``device=torch.cuda.current_device()`` for the
  all-reduced micro-batch count). ``torch.cuda.Stream``/``current_stream`` do not work in a CPU build of torch:
  inside ``get_model`` only, :func:`_no_cuda_stream` hands out torch's CPU streams (their waits are no-ops).
* slime's ``initialize.init`` asserts ``numpy<2`` (slime/backends/megatron_utils/initialize.py:63) and this venv
  has numpy 2; its other steps are called one by one (``set_args``, ``_initialize_distributed``,
  ``_set_random_seed``, ``_build_tokenizer``, ``init_num_microbatches_calculator``).
* the actor's ``_get_rollout_data`` runs unchanged (in ``cpu_device_context``: it puts tensors on
  ``torch.cuda.current_device()``), but the Ray transfer is replaced: its ``process_rollout_data`` returns the dict
  that slime's ``process_rollout_data`` returned in the driver, saved to a file (the workers run no Ray).
* CPU-only Megatron has no TransformerEngine, and the local attention asserts ``packed_seq_params is None``
  (megatron/core/transformer/dot_product_attention.py:159). As slime-ext's integration does in slime's driver
  (``_finish``, run here on both paths), slime's ``--spec`` names slime-ext's THD layer spec, so slime's packed
  ``thd`` micro-batches train (every dynamic case, and every case from v0.3.1). The static cases at v0.2.4/v0.3.0
  keep slime's ``bshd`` format, which slime allows only with fixed micro-batches (slime/utils/arguments.py:1757).
* slime sets ``use_distributed_optimizer`` (``_set_default_megatron_args``); Megatron's ``DistributedOptimizer``
  raises ``TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ...`` for CPU parameters
  (megatron/core/optimizer/distrib_optimizer.py:428), so the worker trains with Megatron's FP32Optimizer (Adam).
* slime's parser calls sglang_router's ``RouterArgs.add_cli_args`` (slime/utils/arguments.py:1010); sglang_router is
  a stubbed GPU-serving module, so parsing runs in ``gpu_stubs.inert_calls()`` (the router's flags are rollout-only).
* slime after v0.3.1 picks its device from its accelerator registry (CUDA or MUSA); a CPU backend is registered
  through slime's own ``register_accelerator`` and ``SLIME_ACCELERATOR=cpu`` (:func:`register_cpu_accelerator`).
* a spy around ``slime.backends.megatron_utils.model.loss_function`` records the normaliser each micro-batch sees
  and calls slime's function unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_stubs  # noqa: E402

VOCAB = 96
#: rollouts as sample lengths (prompt + response); response is the second half
CASES = {
    # one sample per rollout: slime's path and slime-ext's step over the same samples with the same counts
    # (micro-batches of 2: slime pairs each rank's samples in order, slime-ext pairs them by its own plan)
    "one_sample": dict(rollouts=[[12], [30], [17], [25], [40], [9], [21], [33], [14], [28], [19], [36], [10], [24],
                                 [31], [16]], gbs=8, mbs=2),
    # multi-sample rollouts: slime-ext keeps rollouts whole, so its steps hold 3..5 samples, not 4
    # (static micro-batches: slime-ext needs a multiple of dp samples per step, here 8 and 6)
    "multi_sample": dict(rollouts=[[12, 20], [30], [17, 9, 14], [25, 8], [40, 11], [9], [21, 16], [33]], gbs=4,
                         mbs=1),
    # dynamic micro-batches (THD, --use-dynamic-batch-size --max-tokens-per-gpu 64): two rollouts of one step each
    # (gbs = every rollout), so both planners train the same samples per step whatever they put on which rank --
    # v0.2.4's --balance-data partitions the whole rollout across ranks, which moves samples between steps
    # one sample per rollout: at v0.2.4 --global-batch-size counts samples, so only then do both paths step alike
    "dynamic": dict(iterations=[[[12], [30], [17], [25], [40], [9], [33], [14]],
                                [[28], [36], [10], [24], [16], [27], [11], [38]]],
                    gbs=8, max_tokens=64, balance_data=False),
    "dynamic_balanced": dict(iterations=[[[12], [30], [17], [25], [40], [9], [33], [14]],
                                         [[28], [36], [10], [24], [16], [27], [11], [38]]],
                             gbs=8, max_tokens=64, balance_data=True),
    # v0.3.0 and later step by rollouts: multi-sample rollouts stay whole under both planners
    "dynamic_multi": dict(iterations=[[[12, 20], [30], [17, 9, 14], [25], [40, 11], [9], [21, 16], [33]],
                                      [[28, 19], [36], [10], [24, 31], [16], [27, 8, 13], [11, 22], [38]]],
                          gbs=8, max_tokens=64, balance_data=True),
}
_ONE_SAMPLE = ["dynamic", "dynamic_balanced", "multi_sample", "one_sample"]
#: the cases each tag trains: static micro-batches (bshd where slime still has --qkv-format, else thd) and dynamic
TAG_CASES = {"v0.2.4": _ONE_SAMPLE, "v0.3.0": sorted(CASES), "v0.3.1": sorted(CASES), "HEAD": sorted(CASES)}
#: the tags whose slime still has --qkv-format (the static cases there run bshd, as before THD attention existed)
QKV_FORMAT_TAGS = ("v0.2.4", "v0.3.0")
LR, WARMUP_ITERS = 1e-2, 8


def iterations(case: dict) -> list[list[list[int]]]:
    """The case's rollouts per training call (rollout id): ``iterations`` or the one ``rollouts``."""
    return case.get("iterations") or [case["rollouts"]]


def first_token(i: int) -> int:
    """The first token of sample ``i`` (counted over all the case's iterations): unique for ``i < VOCAB``, so the
    loss spy can tell which samples a micro-batch holds."""
    return (7 * i + 1) % VOCAB


def train_data(case: dict, iteration: int = 0) -> dict:
    """slime's train data: deterministic tokens, the response (loss) is the second half of each sample."""
    tokens, loss_masks, response_lengths, index = [], [], [], []
    offset = sum(len(r) for it in iterations(case)[:iteration] for r in it)
    for rid, lengths in enumerate(iterations(case)[iteration]):
        for length in lengths:
            i = offset + len(tokens)
            tokens.append([(7 * i + 3 * j + 1) % VOCAB for j in range(length)])
            response = length - length // 2
            response_lengths.append(response)
            loss_masks.append([1] * response)
            index.append(rid)
    n = len(tokens)
    return {"tokens": tokens, "response_lengths": response_lengths, "loss_masks": loss_masks,
            "rewards": [0.0] * n, "raw_reward": [0.0] * n, "truncated": [0] * n, "sample_indices": index}


def rollout_args(case: dict) -> SimpleNamespace:
    """What the RolloutManager reads off slime's args (and slime-ext's planner)."""
    dynamic = "max_tokens" in case
    return SimpleNamespace(
        dp_schedule="rollout", global_batch_size=case["gbs"], micro_batch_size=case.get("mbs", 1),
        use_dynamic_batch_size=dynamic, max_tokens_per_gpu=case.get("max_tokens"),
        balance_data=case.get("balance_data", False), balance_by_flops=False,
        use_dynamic_global_batch_size=False, disable_rollout_trim_samples=False, context_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, microbatch_group_size_per_vp_stage=None,
        pipeline_model_parallel_size=1, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=4,
        kv_channels=8, ffn_hidden_size=64, vocab_size=VOCAB, num_experts=None, swiglu=False, use_wandb=False,
        use_tensorboard=False, custom_megatron_init_path=None, qkv_format="thd" if dynamic else "bshd")


def grouped_data(case: dict, iteration: int, tag: str) -> dict:
    """The same samples in the layout of slime v0.3.0 (``group_ids``, one per rollout, and ``group_mask_sums``, the
    loss tokens of the sample's whole group: slime's per-rollout loss denominator) or v0.3.1 and later (the same as
    ``rollout_ids`` and ``rollout_mask_sums``)."""
    data = train_data(case, iteration)
    groups = data.pop("sample_indices")
    totals: dict[int, int] = {}
    for g, mask in zip(groups, data["loss_masks"]):
        totals[g] = totals.get(g, 0) + sum(mask)
    ids, sums = ("group_ids", "group_mask_sums") if tag == "v0.3.0" else ("rollout_ids", "rollout_mask_sums")
    data["sample_indices"] = list(range(len(groups)))
    data[ids] = groups
    data[sums] = [float(totals[g]) for g in groups]
    return data


def prepare(case_name: str, out: Path, tag: str, dp: int = 2) -> dict:
    import ray
    import torch

    from slime_ext.integrations import slime as integration
    from slime_ext.patches import slime_host

    case = CASES[case_name]
    import slime.ray.rollout as rollout_module
    from slime.utils.data import process_rollout_data

    summary = {}
    for attempt in range(3):  # raylet start has a fixed 30 s limit; a loaded machine can miss it
        try:
            ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    try:
        for path in ("slime", "ext"):
            if path == "ext":
                integration.enable()  # patches RolloutManager in this driver, as Ray would ship it
            manager_cls = slime_host.rollout_manager_classes(rollout_module)[0]
            manager = object.__new__(manager_cls)
            for k in range(len(iterations(case))):
                manager.args, manager.rollout_id = rollout_args(case), k
                if tag == "v0.2.4":
                    refs = manager._split_train_data_by_dp(train_data(case, k), dp)
                else:  # v0.3.0+: slime plans on the rollout side (slime-ext: its build_dp_schedule, bound by enable())
                    manager.train_parallel_config = {"dp_size": dp, "cp_size": 1, "vpp_size": 1,
                                                     "microbatch_group_size_per_vp_stage": 1}
                    refs = manager._split_train_data_by_dp(grouped_data(case, k, tag))
                for r in range(dp):
                    rollout_data = process_rollout_data(manager.args, refs, r, dp)
                    torch.save(rollout_data, out / f"{path}-it{k}-rank{r}.pt")
                    summary[f"{path}-it{k}-rank{r}"] = sorted(rollout_data)
    finally:
        ray.shutdown()
    return summary


# ------------------------------------------------------------------------------------------------------ training
def megatron_argv(case: dict, load_dir: Path, path: str, tag: str) -> list[str]:
    dynamic = "max_tokens" in case
    if dynamic:  # rollouts per training call; THD (slime's default, the only format from v0.3.1)
        n, seq = len(iterations(case)[0]), 128
        batch = ["--micro-batch-size", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
                 str(case["max_tokens"])] + (["--balance-data"] if case["balance_data"] else [])
    else:
        n, seq = sum(len(r) for r in case["rollouts"]), 64
        batch = ["--micro-batch-size", str(case["mbs"])]
    if tag in QKV_FORMAT_TAGS:
        batch += ["--qkv-format", "thd" if dynamic else "bshd"]
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        *batch, "--global-batch-size", str(case["gbs"]),
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--transformer-impl", "local", "--normalization", "LayerNorm", "--position-embedding-type", "rope",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--use-cpu-initialization",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--lr", str(LR), "--min-lr", "0.0", "--lr-decay-style", "constant", "--lr-warmup-init", str(LR / 2), "--lr-decay-iters", "100",
        "--lr-warmup-iters", str(WARMUP_ITERS), "--weight-decay", "0.0", "--clip-grad", "1e9",
        "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--seed", "1234",
        "--load", str(load_dir), "--no-load-optim", "--no-load-rng",
        "--loss-type", "sft_loss",
        "--num-rollout", str(len(iterations(case))), "--rollout-batch-size", str(n), "--n-samples-per-prompt", "1",
        "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2", "--debug-train-only",
        "--distributed-backend", "gloo", "--distributed-timeout-minutes", "20",
    ]
    return argv


def parse_megatron_args(argv: list[str]):
    """slime's own parsing of the train-side args (megatron's parser + slime's arguments + slime's defaults)."""
    from slime.backends.megatron_utils.arguments import megatron_parse_args
    from slime.backends.megatron_utils.arguments import validate_args as megatron_validate_args
    from slime.utils.arguments import get_slime_extra_args_provider

    saved = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        with gpu_stubs.inert_calls():  # slime's parser registers sglang_router's flags (RouterArgs.add_cli_args)
            args = megatron_parse_args(extra_args_provider=get_slime_extra_args_provider(), skip_hf_validate=True)
    finally:
        sys.argv = saved
    args.bf16 = False  # slime defaults to bf16 (not fp16); CPU trains in fp32
    # slime forces the distributed optimizer; megatron's DistributedOptimizer refuses CPU tensors
    # (megatron/core/optimizer/distrib_optimizer.py:428), so the plain FP32Optimizer (Adam) is used
    args.use_distributed_optimizer = False
    args.rank = int(os.environ["RANK"])
    args.world_size = int(os.environ["WORLD_SIZE"])
    megatron_validate_args(args)
    return args


@contextlib.contextmanager
def _no_cuda_stream():
    """``torch.cuda.Stream()`` cannot be built by a CPU torch, nor ``torch.cuda.current_stream()`` answered.
    megatron.training's ``get_model`` only uses them to order the DDP wrap on a side stream
    (``with torch.cuda.stream(torch.cuda.Stream())`` at 3714d81d; ``ddp_stream.wait_stream(current_stream())`` and
    back at 1dcf0daf); inside ``get_model`` only, both are torch's CPU streams, whose waits are no-ops."""
    import torch

    original = torch.cuda.Stream, torch.cuda.current_stream
    torch.cuda.Stream = lambda *a, **k: torch.cpu.Stream()
    torch.cuda.current_stream = lambda *a, **k: torch.cpu.current_stream()
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.current_stream = original


def register_cpu_accelerator() -> bool:
    """slime after v0.3.1 asks its accelerator registry for the device (``slime.utils.accelerator``: cuda or musa,
    else "No usable accelerator was detected"). A CPU backend goes in through slime's own extension point,
    ``register_accelerator`` + ``SLIME_ACCELERATOR``; nothing of slime is patched. False where slime has no registry."""
    try:
        from slime.utils import accelerator
    except ImportError:
        return False
    if not hasattr(accelerator, "register_accelerator"):
        return False
    import torch
    from slime.utils.accelerator.base import Accelerator

    class CPUAccelerator(Accelerator):
        name, device_type, communication_backend_name = "cpu", "cpu", "gloo"

        def is_available(self):
            return True

        def device(self, index=None):
            return torch.device("cpu")

        def device_name(self, index=None):
            return "cpu"

        def set_device(self, index):
            pass

        def current_device(self):
            return "cpu"  # the contract: "the current local device index, or ``cpu`` for CPU"

        def device_count(self):
            return 1

        def synchronize(self, device=None):
            pass  # CPU kernels are synchronous

        def current_stream(self, device=None):
            return None  # "None when streams are unsupported"

        def empty_cache(self):
            pass

        def mem_get_info(self, device=None):
            return (0, 0)

        def memory_allocated(self, device=None):
            return 0

        def memory_reserved(self, device=None):
            return 0

    accelerator.register_accelerator("cpu", CPUAccelerator, lambda: True, priority=0,
                                     communication_backends=("gloo",))
    os.environ["SLIME_ACCELERATOR"] = "cpu"
    accelerator.reset_accelerator()
    return True


def train(case_name: str, path: str, out: Path, tag: str) -> dict:
    import torch
    import torch.distributed as dist

    from slime_ext.patches import megatron_cpu

    case = CASES[case_name]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(1)
    megatron_cpu.apply_if_no_gpu()
    register_cpu_accelerator()

    load_dir = out / f"empty-load-{path}"
    load_dir.mkdir(exist_ok=True)
    args = parse_megatron_args(megatron_argv(case, load_dir, path, tag))
    from slime_ext.integrations import slime as integration

    # what slime-ext's parse_args hook does in slime's driver: without TE, --spec := the THD layer spec (both paths:
    # slime's own planner is --dp-schedule legacy); slime-ext's path also routes --custom-megatron-init-path
    args.dp_schedule = "rollout" if path == "ext" else "legacy"
    integration._finish(args)

    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.training.global_vars import _build_tokenizer, set_args

    from slime.backends.megatron_utils import initialize as slime_init

    set_args(args)
    slime_init._initialize_distributed(args)
    slime_init._set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker,
                                args.inference_rng_tracker)
    _build_tokenizer(args)
    init_num_microbatches_calculator(args.rank, args.rampup_batch_size, args.global_batch_size,
                                     args.micro_batch_size, args.data_parallel_size,
                                     args.decrease_batch_size_if_needed)
    if getattr(args, "custom_megatron_init_path", None):  # slime's init runs the hook last
        from slime.utils.misc import load_function

        load_function(args.custom_megatron_init_path)(args)

    import slime.backends.megatron_utils.actor as actor_module
    import slime.backends.megatron_utils.model as model_module
    from megatron.core import mpu

    with megatron_cpu.cpu_device_context(), _no_cuda_stream():
        model, optimizer, scheduler = model_module.setup_model_and_optimizer(args, "actor")

    initial = {name: p.detach().clone() for name, p in model[0].named_parameters()}
    seen = []
    original_loss = model_module.loss_function

    def loss_spy(args_, batch, num_microbatches, *rest):
        # v0.2.4: (args, batch, num_microbatches, logits); v0.3.0+: (..., step_global_batch_size, logits)
        tokens = batch.get("unconcat_tokens")  # THD: the samples before packing; bshd: rows of "tokens"
        tokens = batch["tokens"] if tokens is None else tokens
        seen.append({"dynamic_global_batch_size": batch.get("dynamic_global_batch_size"),
                     "step_global_batch_size": int(rest[0]) if len(rest) == 2 else None,
                     "num_microbatches": int(num_microbatches), "samples": len(batch["response_lengths"]),
                     "first_tokens": [int(t[0]) for t in tokens],
                     "packed": batch.get("packed_seq_params") is not None})
        return original_loss(args_, batch, num_microbatches, *rest)

    model_module.loss_function = loss_spy

    num_microbatches, global_batch_sizes, samples_per_step, micro_batch_indices, local_samples = [], [], [], [], 0
    lrs = []
    for k in range(len(iterations(case))):
        # the actor's own _get_rollout_data (tensors on current_device(), max_seq_lens for bshd); the Ray transfer
        # of process_rollout_data's result is replaced by the file the driver wrote
        loaded = torch.load(out / f"{path}-it{k}-rank{rank}.pt", weights_only=False)
        saved_process = actor_module.process_rollout_data
        actor_module.process_rollout_data = lambda args_, ref, dp_rank, dp_size: loaded
        try:
            with megatron_cpu.cpu_device_context():
                rollout_data = actor_module.MegatronTrainRayActor._get_rollout_data(SimpleNamespace(args=args), None)
        finally:
            actor_module.process_rollout_data = saved_process
        local_samples += len(rollout_data["tokens"])
        micro_batch_indices.append([list(map(int, mb)) for mb in rollout_data.get("micro_batch_indices", [])])
        if tag == "v0.2.4":
            with megatron_cpu.cpu_device_context():  # v0.2.4 allocates the micro-batch count on current_device()
                data_iterator, counts = actor_module.get_data_iterator(args, model, rollout_data)
            model_module.train(k, model, optimizer, scheduler, data_iterator, counts)
        else:  # as the v0.3.x actor's train_actor: the schedule comes with the data
            data_iterator = actor_module.get_data_iterator(rollout_data)
            counts = list(rollout_data["num_microbatches"])
            global_batch_sizes += list(rollout_data["global_batch_sizes"])
            model_module.train(k, model, optimizer, scheduler, data_iterator, counts,
                               list(rollout_data["global_batch_sizes"]))
        num_microbatches += list(counts)
        samples_per_step += list(getattr(data_iterator[0], "slime_ext_samples_per_step", None) or [])
        lrs.append([g["lr"] for g in optimizer.param_groups])

    params = {name: p.detach().clone() for name, p in model[0].named_parameters()}
    result = {
        "rank": rank, "path": path, "tag": tag, "global_batch_sizes": global_batch_sizes if tag != "v0.2.4" else None,
        "micro_batch_indices": micro_batch_indices,
        "params": params, "initial_params": initial,
        "get_data_iterator_replaced": hasattr(actor_module.get_data_iterator, "__wrapped__"),
        "num_microbatches": list(num_microbatches),
        "samples_per_step": samples_per_step or None, "scheduler_num_steps": int(scheduler.num_steps),
        "lr": [g["lr"] for g in optimizer.param_groups], "lr_after_each_rollout": lrs, "loss_calls": seen,
        "local_samples": local_samples, "spec": list(args.spec) if args.spec else None,
        "core_attention": sorted({type(m).__name__ for name, m in model[0].named_modules()
                                  if name.endswith("core_attention")}),
        "get_data_iterator": f"{actor_module.get_data_iterator.__module__}.{actor_module.get_data_iterator.__name__}",
        "train_one_step_wrapped": hasattr(model_module.train_one_step, "__wrapped__"),
        "args": {k: getattr(args, k, None) for k in ("global_batch_size", "micro_batch_size", "lr", "lr_warmup_iters",
                                               "train_iters", "use_distributed_optimizer", "qkv_format",
                                               "transformer_impl", "bf16", "fp16")},
        "lr_warmup_steps": scheduler.lr_warmup_steps,
    }
    torch.save(result, out / f"{path}-result-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "ok": True}


def main() -> None:
    gpu_stubs.install()  # here, not at import: the test module reads CASES from this file
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["prepare", "train"])
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--path", choices=["slime", "ext"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", choices=sorted(TAG_CASES), default="v0.2.4")
    ns = parser.parse_args()
    if ns.phase == "prepare":
        result = prepare(ns.case, ns.out, ns.tag)
    else:
        result = train(ns.case, ns.path, ns.out, ns.tag)
    print("SLIME_TRAIN_JSON " + json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    main()
