"""What megatron-core 0.16 to 0.20 (and Megatron-LM's own training loop) need to train on a CPU-only host with gloo.

Supported range ``megatron-core>=0.16.0rc0,<0.21`` (dev builds included: slime pins Megatron-LM commits that report
``0.16.0rc0``); checked with torch 2.13.0 against megatron-core 0.16.1 (Python 3.11) and 0.17.1, 0.18.2, 0.19.2
(Python 3.12) from PyPI, and against the Megatron-LM trees core_v0.16.1 (0.16.1), core_v0.19.0 (0.19.1) and HEAD
d98e8a6 (0.20.0) running ``train_rl.py``'s RL loop (``ci/megatron_rl_test``). The version is read from the imported
``megatron.core.package_info`` (:func:`megatron_core_version`), not from pip's metadata, so a Megatron-LM source
tree on ``PYTHONPATH`` is judged by what it is; each patch also checks that its target exists and still holds the
CUDA call it is there for. Patches for calls that appeared in 0.19 (:data:`FROM_0_19`) are applied when the imported
code has the call -- required from 0.19 on, skipped before unless a dev tree already has it. Outside the range every
patch refuses with a ``PatchError`` naming version and range.

:func:`apply_if_no_gpu` applies the set only when ``torch.cuda.is_available()`` is false; on a GPU host nothing is
touched. Everything below exists because megatron-core assumes a CUDA device in code paths that CPU training runs:

1. ``torch.cuda.current_device()`` as the ``device=`` of many allocations (pipeline p2p receive buffers and shape
   exchange, DDP gradient buffers) and ``torch.cuda.synchronize()`` after p2p shape exchange;
2. literal ``device="cuda"`` / ``device='cuda'`` tensors (token counters in the pipeline schedules, the default
   causal mask, the FP32 optimizer's unit loss scale, the grad-norm buffers of the local multi-tensor fallback);
3. ``Tensor.cuda()`` in the tied word-embedding sync of ``LanguageModule`` (PP > 1);
4. the CUDA RNG tracker (``CudaRNGStatesTracker.add`` and ``.fork``), which dropout and model init run under;
5. ``clip_grad_by_total_norm_fp32`` asserting ``param.grad.type() == 'torch.cuda.FloatTensor'``;
6. blocking, untagged batched p2p (``_batched_p2p_ops`` and ``P2PCommunicator._communicate_shapes``, which wait on
   every request of a call, sends included). Two gloo properties break that on CPU:
   (a) gloo matches messages between two ranks by ``(peer, tag)`` in posting order (the ``batch_isend_irecv``
   contract); with PP=2 the previous and the next stage are one peer, so when the interleaved (VPP) schedule sends
   an activation forward and a gradient backward in one call, the untagged messages cross (with variable sequence
   lengths that shows as a shape mismatch in attention; with fixed lengths it would be silent);
   (b) a gloo send completes only once the peer has posted the matching receive. The pipeline schedules pair one
   rank's call with a *later* call on its peer (e.g. PP=2, VPP=2 and two micro-batches: stage 0 finishes its
   warmup with a forward send while stage 1 already sends a gradient back), and waiting for that send inside the
   call deadlocks. NCCL hides this because its ``wait()`` only orders CUDA streams.
7. from 0.19: ``torch.cuda.current_stream()`` in the DDP bucket group's ``start_grad_sync`` (it waits on CUDA-graph
   events, which a CPU run never has) and a ``device='cuda'`` flag tensor in ``MegatronOptimizer.has_grad_norm_group``.

8. Megatron-LM's own training (a checkout's ``megatron/training`` and ``megatron/rl``, not in the wheel):
   ``get_model`` wraps the chunks in DDP on a ``torch.cuda.Stream()`` (``torch.cuda.stream``, ``current_stream().
   wait_stream``), and Megatron-RL's data preparation, log-prob passes and ``train_rl.forward_step`` call ``.cuda()``,
   ``device='cuda'``, ``torch.cuda.synchronize`` throughout; ``train()`` keeps ``v.cpu()`` of the model's state dict
   as the RL reference weights, which on a CPU tensor is the tensor itself (see :data:`MEGATRON_LM_PATCHES`).

How they are fixed, narrowest first:

* **The CPU device context** (:func:`cpu_device_context`): a thread-local flag plus a
  ``torch.overrides.TorchFunctionMode`` that rewrites a CUDA ``device=`` argument (``"cuda"``, ``"cuda:N"``, a CUDA
  ``torch.device``, an int index) to CPU, turns ``pin_memory=True`` off, makes ``Tensor.cuda()`` return the
  tensor and ``Tensor.cpu()`` return a copy (what either does to the CUDA tensor the code expects). It is entered
  only *inside* the megatron functions listed in :data:`CONTEXT_WRAPPED` (each patch wraps one of them, and checks
  that the function still contains the CUDA call it is there for) and, for Megatron-LM's own training loop, in
  :data:`MEGATRON_LM_CONTEXT_WRAPPED` (``setup_model_and_optimizer`` and ``train``: coarse on purpose, since
  Megatron-RL's CUDA calls move with every release; :func:`apply_megatron_lm_if_no_gpu`). Outside those
  functions torch behaves exactly as before. The mode and the flag are **thread-local**: they are active on the
  thread that called the wrapped function, which is where megatron runs these calls (CPU autograd runs
  backward on the calling thread too). Code that calls megatron internals not in the list from another thread can
  still enter :func:`cpu_device_context` itself.
* ``torch.cuda.current_device`` and ``torch.cuda.synchronize`` are replaced by dispatchers that answer for the CPU
  (``torch.device("cpu")`` -- a device, where upstream returns an int index; megatron only uses it as a
  ``device=`` -- and a no-op, CPU kernels and waited-on gloo work being synchronous) **only inside the context**;
  outside it they call the original, which raises on a CPU-only host as before. From 0.19 ``torch.cuda.current_stream``
  likewise answers ``torch.cpu.current_stream()`` inside the context (its ``wait_event``/``wait_stream`` are
  no-ops: CPU work is synchronous); with Megatron-LM's training so do ``torch.cuda.Stream()`` (a ``torch.cpu.
  Stream``) and ``torch.cuda.stream(s)`` (``torch.cpu.stream``, a no-op context), on every version.
* ``CudaRNGStatesTracker.add``/``.fork`` are replaced by the same bookkeeping over the CPU default generator: named
  states are CPU generator states, ``fork`` swaps ``torch.get_rng_state``/``set_rng_state`` in and out.
* ``_batched_p2p_ops`` and ``P2PCommunicator._communicate_shapes`` are replaced by the same exchanges with one
  tag per direction (activations forward, gradients backward; shapes and tensors apart), so matching no longer
  depends on posting order, and whose sends complete **asynchronously**: only receives are waited on in the call
  (their data is needed), send requests are kept and waited on when the schedule function returns (the three
  schedule wrappers drain them), so a send can complete during the peer's later call. The sent tensors stay
  referenced until then and Megatron does not modify their contents; Megatron-LM's training sets
  ``deallocate_pipeline_outputs=True``, which swaps a sent output's ``.data`` for a one-element tensor right after
  the send and would free the storage an in-flight gloo send reads, so each pending send also holds a ``detach()``
  alias of its tensor until it completes (without it DP2xPP2 RL training sent freed memory and its loss went NaN).
  The interleaved schedule's overlapped p2p (``overlap_p2p_comm``: ``_p2p_ops``, unbatched ``isend``/``irecv``
  whose handles the schedule waits on later) has the same hazard: its send handles are wrapped the same way, so the
  storage lives until the schedule waits on the send (without it, Megatron-LM core_v0.16.1's DP2xPP2xVPP2 RL step
  trained one micro-batch on an activation whose storage had been freed and reused).
  ``use_ring_exchange_p2p`` still goes to the original.
* ``clip_grad_by_total_norm_fp32`` (as looked up by ``megatron.core.optimizer.optimizer``) is replaced by the same
  math without the CUDA type assertion: fp32 grads are scaled in place by ``max_norm / (total_norm + 1e-6)``
  when that is below one.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import ImportedVersion, Patch, PatchError, PatchSet, _resolve, imported_version, source_contains

MEGATRON = "megatron-core"
#: every megatron patch's range; ``rc0`` so that dev builds of 0.16.0 (slime's pinned Megatron-LM) are accepted
MEGATRON_SUPPORTED = ">=0.16.0rc0,<0.21"
MEGATRON_TESTED = ("0.16.1", "0.17.1", "0.18.2", "0.19.1", "0.19.2", "0.20.0")
#: the patches for CUDA calls that appeared in 0.19 are required from here on (before: only if the code has the call)
FROM_0_19 = ">=0.19.0rc0"
TORCH_SUPPORTED = ">=2.4"
TORCH_TESTED = ("2.13.0+cpu", "2.13.0+cu130")


def megatron_core_version() -> ImportedVersion:
    """The version of the megatron-core that is imported: ``megatron.core.package_info.__version__`` (a source
    checkout reports its own), with where it was read."""
    return imported_version("megatron.core.package_info", "__version__", MEGATRON)

_CPU = torch.device("cpu")
_local = threading.local()


# ---------------------------------------------------------------------------------------------------- the context
def in_cpu_device_context() -> bool:
    """True on a thread that is inside :func:`cpu_device_context`."""
    return getattr(_local, "depth", 0) > 0


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    # an int device index: on a CPU-only host it can only come from code that assumed a GPU
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrite CUDA device arguments of torch calls to CPU; ``Tensor.cuda()`` returns the tensor itself and
    ``Tensor.cpu()`` a copy, as it does for the CUDA tensor the code was written for (on a CPU tensor it would
    return the tensor itself: Megatron-LM's ``train()`` keeps ``v.cpu()`` of the model's state dict as the RL
    reference weights, which would then be the trained weights themselves)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.cpu and not kwargs and len(args) == 1 and args[0].device.type == "cpu":
            return args[0].clone()
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_context() -> Iterator[None]:
    """Run megatron-core's CUDA-assuming calls on the CPU (re-entrant, thread-local)."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    try:
        if depth:
            yield
        else:
            with _CudaToCpuMode():
                yield
    finally:
        _local.depth = depth


def _pending_sends() -> list:
    if not hasattr(_local, "sends"):
        _local.sends = []
    return _local.sends


def drain_pending_sends() -> None:
    """Wait for every p2p send this thread left in flight (see the p2p patches)."""
    sends = _pending_sends()
    while sends:
        sends.pop(0).wait()


def _run_schedule_in_cpu_context(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with cpu_device_context():
            try:
                result = original(*args, **kwargs)
            except BaseException:
                _pending_sends().clear()  # the job is failing; do not block on a peer that may be gone
                raise
            drain_pending_sends()
            return result

    return wrapper


def _run_in_cpu_context(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with cpu_device_context():
            return original(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------------------------------------------- torch.cuda
def _current_device(original: Callable) -> Callable:
    @functools.wraps(original)
    def current_device():
        if in_cpu_device_context():
            return _CPU
        return original()

    return current_device


def _synchronize(original: Callable) -> Callable:
    @functools.wraps(original)
    def synchronize(device=None):
        if in_cpu_device_context():
            return None
        return original(device)

    return synchronize


def _current_stream(original: Callable) -> Callable:
    @functools.wraps(original)
    def current_stream(device=None):
        if in_cpu_device_context():
            return torch.cpu.current_stream()
        return original(device)

    return current_stream


def _stream_class(original: Callable) -> Callable:
    @functools.wraps(original, updated=())
    def Stream(*args, **kwargs):
        if in_cpu_device_context():
            return torch.cpu.Stream()
        return original(*args, **kwargs)

    return Stream


def _stream_context(original: Callable) -> Callable:
    @functools.wraps(original)
    def stream(stream):
        if in_cpu_device_context():
            return torch.cpu.stream(stream)
        return original(stream)

    return stream


# ---------------------------------------------------------------------------------------------------- RNG tracker
def _tracker_add(original: Callable) -> Callable:
    @functools.wraps(original)
    def add(self, name, seed):
        """Track a named RNG state: a CPU generator seeded with ``seed`` (upstream: a CUDA generator state)."""
        if self.use_cudagraphable_rng:
            raise PatchError("the CPU RNG tracker (patches.megatron_cpu) cannot serve use_cudagraphable_rng=True; "
                             "CUDA graphs need a GPU")
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(int(seed)).get_state()

    return add


def _tracker_fork(original: Callable) -> Callable:
    from megatron.core.tensor_parallel import random as mrandom

    default_name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

    @contextlib.contextmanager
    def fork(self, name=default_name):
        """Swap the named state into the CPU default generator for the block (upstream: the CUDA generator)."""
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise Exception(f"current state name {self._current_state_name} is not the same as the desired "
                                f"state name {name}.")
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name

    functools.update_wrapper(fork, original)
    return fork


# ---------------------------------------------------------------------------------------------------- grad clipping
def _clip_grad_by_total_norm_fp32(original: Callable) -> Callable:
    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        """Scale fp32 grads in place by ``max_norm / (total_norm + 1e-6)`` when below 1 (CPU: no CUDA type check)."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = []
        for param in parameters:
            grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
            if grad is None:
                continue
            if grad.dtype != torch.float32:
                raise PatchError(f"clip_grad_by_total_norm_fp32 expects fp32 grads, got {grad.dtype}")
            grads.append(grad.detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            for grad in grads:
                grad.mul_(clip_coeff)

    return clip_grad_by_total_norm_fp32


# ---------------------------------------------------------------------------------------------------- tagged p2p
#: gloo message tags: activations flow to the next stage (send_next / recv_prev), gradients to the previous one
_TAG_FORWARD, _TAG_BACKWARD = 1, 2
_TAG_SHAPE_FORWARD, _TAG_SHAPE_BACKWARD = 3, 4


def _p2p_op(send: bool, tensor: torch.Tensor, peer: int, group, tag: int):
    dist = torch.distributed
    return dist.P2POp(dist.isend if send else dist.irecv, tensor, peer, group, tag)


def _batched_p2p_ops(original: Callable) -> Callable:
    @functools.wraps(original)
    def batched_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                        prev_pipeline_rank, next_pipeline_rank):
        """Upstream's batched isend/irecv, each direction under its own tag; sends complete asynchronously."""
        ops = []
        if tensor_send_prev is not None:
            ops.append(_p2p_op(True, tensor_send_prev, prev_pipeline_rank, group, _TAG_BACKWARD))
        if tensor_recv_prev is not None:
            ops.append(_p2p_op(False, tensor_recv_prev, prev_pipeline_rank, group, _TAG_FORWARD))
        if tensor_send_next is not None:
            ops.append(_p2p_op(True, tensor_send_next, next_pipeline_rank, group, _TAG_FORWARD))
        if tensor_recv_next is not None:
            ops.append(_p2p_op(False, tensor_recv_next, next_pipeline_rank, group, _TAG_BACKWARD))
        return _start(ops)

    return batched_p2p_ops


def _start(ops: list) -> list:
    """Post ``ops``; returns the receive requests, keeps the send requests pending (see the module docstring)."""
    if not ops:
        return []
    reqs = torch.distributed.batch_isend_irecv(ops)
    recvs = []
    for op, req in zip(ops, reqs):
        if op.op is torch.distributed.irecv:
            recvs.append(req)
        else:
            _pending_sends().append(_PendingSend(req, op.tensor.detach()))
    return recvs


class _PendingSend:
    """A send still in flight, with a second reference to the sent tensor's storage.

    Megatron-LM's training sets ``deallocate_pipeline_outputs=True``: right after a stage sends its output it
    replaces the output's ``.data`` by a one-element tensor (``schedules.deallocate_output_tensor``), which frees the
    storage a gloo send that has not completed yet still reads from (gloo posts the buffer's address). Holding a
    ``detach()`` alias keeps that storage, with its unchanged contents, alive until the send completes."""

    __slots__ = ("request", "storage")

    def __init__(self, request, storage: torch.Tensor):
        self.request, self.storage = request, storage

    def wait(self):
        try:
            return self.request.wait()
        finally:
            self.storage = None


def _p2p_ops(original: Callable) -> Callable:
    @functools.wraps(original)
    def p2p_ops(**kwargs):
        """Upstream's unbatched isend/irecv (the overlapped p2p of the interleaved schedule), its send handles holding
        the sent tensors' storage until they are waited on (:class:`_PendingSend`)."""
        reqs = original(**kwargs)
        sent = {"send_next": kwargs.get("tensor_send_next"), "send_prev": kwargs.get("tensor_send_prev")}
        if isinstance(reqs, dict):
            return {key: _PendingSend(req, sent[key].detach()) if sent.get(key) is not None else req
                    for key, req in reqs.items()}
        return reqs

    return p2p_ops


def _communicate_shapes(original: Callable) -> Callable:
    @functools.wraps(original)
    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        """Upstream's shape exchange on CPU tensors, one tag per direction; waits for the receives only."""
        if self.config.use_ring_exchange_p2p:
            return original(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)
        ops = []
        recv_prev_shape = torch.empty((3,), dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty((3,), dtype=torch.int64) if recv_next else None
        if tensor_send_prev is not None:
            shape = torch.tensor(tensor_send_prev.size(), dtype=torch.int64)
            ops.append(_p2p_op(True, shape, self.prev_rank, self.pp_group, _TAG_SHAPE_BACKWARD))
        if recv_prev_shape is not None:
            ops.append(_p2p_op(False, recv_prev_shape, self.prev_rank, self.pp_group, _TAG_SHAPE_FORWARD))
        if tensor_send_next is not None:
            shape = torch.tensor(tensor_send_next.size(), dtype=torch.int64)
            ops.append(_p2p_op(True, shape, self.next_rank, self.pp_group, _TAG_SHAPE_FORWARD))
        if recv_next_shape is not None:
            ops.append(_p2p_op(False, recv_next_shape, self.next_rank, self.pp_group, _TAG_SHAPE_BACKWARD))
        for req in _start(ops):
            req.wait()
        return (recv_prev_shape.tolist() if recv_prev_shape is not None else [0, 0, 0],
                recv_next_shape.tolist() if recv_next_shape is not None else [0, 0, 0])

    return communicate_shapes


# ---------------------------------------------------------------------------------------------------- the set
def _mcore(name: str, module: str, attribute: str, make: Callable, doc: str, *needles: str,
           needed: Callable[[], str | None] | None = None) -> Patch:
    return Patch(name=name, module=module, attribute=attribute, make=make, distribution=MEGATRON,
                 supported=MEGATRON_SUPPORTED, tested=MEGATRON_TESTED, doc=doc,
                 expect=source_contains(*needles) if needles else None, version=megatron_core_version,
                 needed=needed)


def code_has_call(module: str, attribute: str, needle: str, required_from: str = FROM_0_19) -> Callable[[], str | None]:
    """A ``needed`` check for a patch that works around a call newer megatron-core versions make: needed when the
    imported ``module.attribute`` contains ``needle`` (a dev tree is judged by its code), and always from
    ``required_from`` on (if the call is gone there, the patch's ``expect`` refuses loudly instead of skipping)."""

    def needed() -> str | None:
        version = megatron_core_version()
        if SpecifierSet(required_from).contains(Version(version.version), prereleases=True):
            return None
        try:
            owner, last = _resolve(module, attribute)
        except PatchError as exc:  # the module or the class is missing
            return f"{exc} in megatron-core {version}"
        if not hasattr(owner, last):
            return f"{module}.{attribute} does not exist in megatron-core {version}"
        check = source_contains(needle)(getattr(owner, last))
        return f"megatron-core {version}: {module}.{attribute} has no {needle} (needed from {required_from})" \
            if check else None

    return needed


#: megatron functions run inside :func:`cpu_device_context`: (name, module, attribute, CUDA call it works around)
CONTEXT_WRAPPED: tuple[tuple[str, str, str, str], ...] = (
    ("schedule_no_pipelining", "megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining",
     'device="cuda"'),
    ("schedule_1f1b", "megatron.core.pipeline_parallel.schedules",
     "forward_backward_pipelining_without_interleaving", 'device="cuda"'),
    ("schedule_interleaved", "megatron.core.pipeline_parallel.schedules",
     "forward_backward_pipelining_with_interleaving", 'device="cuda"'),
    ("ddp_init", "megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel.__init__",
     "_ParamAndGradBuffer("),
    ("tied_embedding_sync", "megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer", "weight.data.cuda()"),
    ("fp32_optimizer_init", "megatron.core.optimizer.optimizer", "FP32Optimizer.__init__", "device='cuda'"),
    ("grad_norm", "megatron.core.optimizer.optimizer", "get_grad_norm_fp32", "device='cuda'"),
    ("count_zeros", "megatron.core.optimizer.optimizer", "count_zeros_fp32", "device='cuda'"),
    # from 0.19 (see :data:`FROM_0_19`)
    # (0.17/0.18 call torch.cuda.current_stream() there too, but only with several distributed-optimizer instances;
    # 0.19's unconditional call is this assignment)
    ("grad_sync_stream", "megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.start_grad_sync",
     "current_stream = torch.cuda.current_stream()"),
    ("grad_norm_group_flag", "megatron.core.optimizer.optimizer", "MegatronOptimizer.has_grad_norm_group",
     "device='cuda'"),
)
#: the CONTEXT_WRAPPED entries that only megatron-core 0.19 (or a dev tree with the same call) needs
NEW_IN_0_19 = ("grad_sync_stream", "grad_norm_group_flag")

_CONTEXT_DOC = {
    "schedule_no_pipelining": "token counter on device='cuda'; finalize_model_grads; the default causal mask",
    "schedule_1f1b": "p2p buffers and shape exchange on current_device(), synchronize(); token counter on 'cuda'",
    "schedule_interleaved": "as schedule_1f1b, for virtual pipeline stages",
    "ddp_init": "gradient/parameter buffers allocated on torch.cuda.current_device()",
    "tied_embedding_sync": "weight.data.cuda() before the first/last-stage all-reduce of tied embeddings (PP > 1)",
    "fp32_optimizer_init": "unit loss scale torch.tensor([1.0], device='cuda')",
    "grad_norm": "norm buffers on device='cuda' (also in the local multi-tensor l2-norm fallback)",
    "count_zeros": "zero counter on device='cuda' (log_num_zeros_in_grad)",
    "grad_sync_stream": "torch.cuda.current_stream() waits on CUDA-graph wgrad events (none on CPU; from 0.19)",
    "grad_norm_group_flag": "the per-group flag all-reduced as a device='cuda' tensor (from 0.19)",
}


def _needed_0_19(name: str) -> Callable[[], str | None]:
    _, module, attribute, needle = next(entry for entry in CONTEXT_WRAPPED if entry[0] == name)
    return code_has_call(module, attribute, needle)


def build_patches() -> PatchSet:
    """A fresh, unapplied :class:`PatchSet` of every CPU patch."""
    patches = [
        Patch(name="cuda_current_device", module="torch.cuda", attribute="current_device", make=_current_device,
              distribution="torch", supported=TORCH_SUPPORTED, tested=TORCH_TESTED,
              doc="inside cpu_device_context: torch.device('cpu') (megatron allocates on current_device())"),
        Patch(name="cuda_synchronize", module="torch.cuda", attribute="synchronize", make=_synchronize,
              distribution="torch", supported=TORCH_SUPPORTED, tested=TORCH_TESTED,
              doc="inside cpu_device_context: a no-op (pipeline p2p synchronises after batched isend/irecv)"),
        Patch(name="cuda_current_stream", module="torch.cuda", attribute="current_stream", make=_current_stream,
              distribution="torch", supported=TORCH_SUPPORTED, tested=TORCH_TESTED,
              doc="inside cpu_device_context: torch.cpu.current_stream() (megatron-core 0.19's start_grad_sync)",
              needed=_needed_0_19("grad_sync_stream")),
        _mcore("rng_tracker_add", "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add", _tracker_add,
               "named RNG states are CPU generator states", "torch.cuda.get_rng_state()"),
        _mcore("rng_tracker_fork", "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork",
               _tracker_fork, "fork swaps the CPU default generator's state", "_set_cuda_rng_state("),
        _mcore("p2p_batched_ops", "megatron.core.pipeline_parallel.p2p_communication", "_batched_p2p_ops",
               _batched_p2p_ops, "batched p2p, one tag per direction, sends complete asynchronously (gloo)",
               "batch_isend_irecv(ops)"),
        _mcore("p2p_ops", "megatron.core.pipeline_parallel.p2p_communication", "_p2p_ops", _p2p_ops,
               "overlapped (unbatched) p2p: a send's handle holds the sent tensor's storage until it is waited on",
               "reqs[\"send_next\"] = send_next_req", "reqs[\"send_prev\"] = send_prev_req"),
        _mcore("p2p_shapes", "megatron.core.pipeline_parallel.p2p_communication",
               "P2PCommunicator._communicate_shapes", _communicate_shapes,
               "shape exchange on CPU, one tag per direction, waits for receives only", "batch_isend_irecv(ops)",
               "torch.cuda.synchronize()"),
        _mcore("clip_grad_fp32", "megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
               _clip_grad_by_total_norm_fp32, "same clipping math without the torch.cuda.FloatTensor assertion",
               "torch.cuda.FloatTensor"),
    ]
    for name, module, attribute, needle in CONTEXT_WRAPPED:
        wrap = _run_schedule_in_cpu_context if name.startswith("schedule_") else _run_in_cpu_context
        extra = "; drains pending p2p sends on return" if name.startswith("schedule_") else ""
        patches.append(_mcore(name, module, attribute, wrap,
                              f"run in cpu_device_context: {_CONTEXT_DOC[name]}{extra}", needle,
                              needed=_needed_0_19(name) if name in NEW_IN_0_19 else None))
    return PatchSet("megatron_cpu", patches)


#: the process-wide patch set used by :func:`apply_if_no_gpu` / :func:`undo`
PATCHES = build_patches()


def apply_if_no_gpu() -> bool:
    """Apply :data:`PATCHES` when no CUDA device is present. Returns whether the patches are (now) applied."""
    if torch.cuda.is_available():
        return False
    PATCHES.apply()
    return True


def undo() -> None:
    """Undo :data:`PATCHES` (no-op if not applied)."""
    PATCHES.undo()


# ---------------------------------------------------------------------------------------------------- Megatron-LM
#: Megatron-LM's training entry points (``megatron.training``, ``megatron.rl``: a Megatron-LM checkout, not the
#: megatron-core wheel) run inside :func:`cpu_device_context`: (name, module, attribute, a call that shows the
#: function is the code the patch was written for)
MEGATRON_LM_CONTEXT_WRAPPED: tuple[tuple[str, str, str, str], ...] = (
    ("mlm_setup_model_and_optimizer", "megatron.training.training", "setup_model_and_optimizer",
     "get_megatron_optimizer("),
    ("mlm_train", "megatron.training.training", "train", "rl_utils.get_grpo_data_iterator("),
)
_MEGATRON_LM_DOC = {
    "mlm_setup_model_and_optimizer": "get_model's DDP wrapping on a torch.cuda.Stream(); CUDA allocations",
    "mlm_train": "the training loop, Megatron-RL's data preparation (.cuda(), device='cuda', "
                 "torch.cuda.synchronize/empty_cache) and train_step",
}
MEGATRON_LM_TESTED = ("0.16.1", "0.19.1", "0.20.0")


def _core_patch_applied(name: str) -> Callable[[], str | None]:
    def needed() -> str | None:
        core = next(p for p in PATCHES if p.name == name)
        return f"megatron_cpu's {name} is applied and answers inside the context" if core.applied else None

    return needed


def build_megatron_lm_patches() -> PatchSet:
    """A fresh, unapplied :class:`PatchSet` for Megatron-LM's own training loop (``pretrain``'s ``setup_model_and_
    optimizer`` and ``train``, with ``train_rl.py``'s RL path) on a CPU-only host; needs :data:`PATCHES` applied
    first (:func:`apply_megatron_lm_if_no_gpu` does both).

    Megatron-LM (core_v0.16.1 to HEAD) wraps model chunks in DDP on a ``torch.cuda.Stream()`` under
    ``torch.cuda.stream(...)`` and ``torch.cuda.current_stream().wait_stream(...)`` (``get_model``), and Megatron-RL
    moves its tensors with ``.cuda()``, allocates with ``device='cuda'`` and calls ``torch.cuda.synchronize`` /
    ``torch.cuda.current_device`` throughout ``prepare_data_for_update``, the log-prob passes, packing and
    ``train_rl.forward_step``. Rather than name each call (they move with every release), the two entry points run
    inside :func:`cpu_device_context`, and the stream API answers with ``torch.cpu``'s no-op streams there.
    """
    torch_patch = functools.partial(Patch, module="torch.cuda", distribution="torch", supported=TORCH_SUPPORTED,
                                    tested=TORCH_TESTED)
    patches = [
        torch_patch(name="mlm_cuda_stream", attribute="Stream", make=_stream_class,
                    doc="inside cpu_device_context: a torch.cpu.Stream (get_model's DDP initialisation stream)"),
        torch_patch(name="mlm_cuda_stream_context", attribute="stream", make=_stream_context,
                    doc="inside cpu_device_context: torch.cpu.stream(...) (a no-op context)"),
        torch_patch(name="mlm_cuda_current_stream", attribute="current_stream", make=_current_stream,
                    doc="inside cpu_device_context: torch.cpu.current_stream() (get_model's wait_stream calls)",
                    needed=_core_patch_applied("cuda_current_stream")),
    ]
    for name, module, attribute, needle in MEGATRON_LM_CONTEXT_WRAPPED:
        patches.append(Patch(name=name, module=module, attribute=attribute, make=_run_in_cpu_context,
                             distribution=MEGATRON, supported=MEGATRON_SUPPORTED, tested=MEGATRON_LM_TESTED,
                             doc=f"run in cpu_device_context: {_MEGATRON_LM_DOC[name]}",
                             expect=source_contains(needle), version=megatron_core_version))
    return PatchSet("megatron_lm_cpu", patches)


#: the process-wide Megatron-LM patch set used by :func:`apply_megatron_lm_if_no_gpu` / :func:`undo_megatron_lm`
MEGATRON_LM_PATCHES = build_megatron_lm_patches()


def apply_megatron_lm_if_no_gpu() -> bool:
    """Apply :data:`PATCHES` and :data:`MEGATRON_LM_PATCHES` when no CUDA device is present (Megatron-LM's own
    ``train()`` on the CPU). Returns whether they are (now) applied."""
    if not apply_if_no_gpu():
        return False
    MEGATRON_LM_PATCHES.apply()
    return True


def undo_megatron_lm() -> None:
    """Undo :data:`MEGATRON_LM_PATCHES` (no-op if not applied); :data:`PATCHES` stay as they are."""
    MEGATRON_LM_PATCHES.undo()
