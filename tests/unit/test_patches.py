"""The Patch framework and the megatron-core CPU patch set: apply, undo, idempotence, loud mismatches."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import slime_ext.patches as patches
from slime_ext.patches import (ImportedVersion, Patch, PatchError, PatchSet, megatron_cpu, on_import,
                              parameters_are, source_contains)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def target_module():
    mod = types.ModuleType("fake_target")

    def greet(name):
        return f"hello {name}"

    class Greeter:
        def hi(self):
            return "hi"

        @staticmethod
        def static():
            return "static"

    mod.greet, mod.Greeter, mod.VERSION = greet, Greeter, "1.2.0"
    sys.modules["fake_target"] = mod
    yield mod
    del sys.modules["fake_target"]


def _patch(attribute="greet", supported=">=1.0,<2", make=None, expect=None, version=None, needed=None):
    return Patch(name="p", module="fake_target", attribute=attribute,
                 make=make or (lambda orig: lambda *a: "patched " + orig(*a)), distribution="fake",
                 supported=supported, tested=("1.2.0",), expect=expect,
                 version=version or (lambda: sys.modules["fake_target"].VERSION), needed=needed)


def test_apply_undo_idempotent(target_module):
    original = target_module.greet
    p = _patch()
    p.apply()
    p.apply()  # no-op, not double-wrapped
    assert target_module.greet("x") == "patched hello x" and p.applied and p.original is original
    p.undo()
    p.undo()
    assert target_module.greet is original and not p.applied


def test_methods_and_staticmethods(target_module):
    cls = target_module.Greeter
    m = _patch("Greeter.hi", make=lambda orig: lambda self: "patched " + orig(self))
    s = _patch("Greeter.static", make=lambda orig: lambda: "patched " + orig())
    m.apply(), s.apply()
    assert cls().hi() == "patched hi" and cls.static() == "patched static" and cls().static() == "patched static"
    s.undo(), m.undo()
    assert cls().hi() == "hi" and isinstance(cls.__dict__["static"], staticmethod)


def test_version_outside_range_is_refused(target_module):
    for version in ("2.0.0", "2.0.0rc1", "0.9"):
        target_module.VERSION = version
        with pytest.raises(PatchError, match=rf"supports fake>=1.0,<2 \(tested: 1.2.0\) but {version} is installed"):
            _patch().apply()
    assert target_module.greet("x") == "hello x"


def test_dev_builds_are_accepted_by_an_rc0_lower_bound(target_module):
    target_module.VERSION = "1.0.0rc0"
    with pytest.raises(PatchError, match="but 1.0.0rc0 is installed"):
        _patch().apply()  # ">=1.0" means the release
    p = _patch(supported=">=1.0.0rc0,<2")
    p.apply()
    assert target_module.greet("x") == "patched hello x"
    p.undo()


def test_a_patch_that_is_not_needed_is_skipped_and_reported(target_module):
    p = _patch(attribute="only_in_2_0", needed=lambda: "only_in_2_0 does not exist here")
    q = _patch()
    ps = PatchSet("s", [p, q])
    ps.apply()  # a missing target is no error when the patch is not needed
    assert ps.applied and q.applied and not p.applied
    assert p.skipped == "only_in_2_0 does not exist here" and "skipped: only_in_2_0" in ps.describe()
    ps.undo()
    assert p.skipped is None and target_module.greet("x") == "hello x"
    with pytest.raises(PatchError, match="does not exist"):  # needed: the same target is checked as usual
        _patch(attribute="only_in_2_0", needed=lambda: None).apply()


def test_missing_target_and_unexpected_source_are_refused(target_module):
    with pytest.raises(PatchError, match="does not exist"):
        _patch("nope").apply()
    with pytest.raises(PatchError, match="no longer contains"):
        _patch(expect=source_contains("torch.cuda.synchronize()")).apply()
    assert target_module.greet("x") == "hello x"
    _patch(expect=source_contains("hello")).apply()


def test_parameters_are_names_what_differs():
    def f(self, data, dp_size):
        return data

    assert parameters_are(("self", "data", "dp_size"))(f) is None
    assert parameters_are(("self", "data"))(f) == (
        "its parameters are ('self', 'data', 'dp_size'), the replacement takes ('self', 'data')")
    assert parameters_are(("self", "dp_size", "data"))(f) is not None  # the order counts
    assert parameters_are(("x",))(42).startswith("cannot read its signature")


def test_undo_refuses_to_drop_a_later_change(target_module):
    p = _patch()
    p.apply()
    target_module.greet = lambda name: "someone else"
    with pytest.raises(PatchError, match="replaced by someone else"):
        p.undo()


def test_patch_set_is_all_or_nothing(target_module):
    good, bad = _patch(), _patch("missing")
    with pytest.raises(PatchError):
        PatchSet("s", [good, bad]).apply()
    assert not good.applied and target_module.greet("x") == "hello x"


# ---------------------------------------------------------------------------------------------------- megatron_cpu
@pytest.fixture
def cpu_patches():
    if torch.cuda.is_available():
        pytest.skip("the CPU patch set is only applied without a GPU")
    ps = megatron_cpu.build_patches()
    ps.apply()
    yield ps
    ps.undo()


def _static(owner, attr):
    return owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)


def _mcore_version() -> Version:
    return Version(megatron_cpu.megatron_core_version().version)


# ------------------------------------------------------------------------------------------------ on import
def test_on_import_acts_before_any_importer_binds_and_at_once_when_imported(tmp_path, monkeypatch):
    (tmp_path / "hook_target_for_test.py").write_text("def f():\n    return 'host'\n")
    (tmp_path / "hook_importer_for_test.py").write_text("from hook_target_for_test import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def patch(module):
        seen.append(module.__name__)
        module.f = lambda: "patched"

    try:
        hook = on_import.arrange("test-owner", {"hook_target_for_test": patch})
        assert on_import.finder("test-owner") is hook and sys.meta_path[0] is hook
        import hook_importer_for_test  # binds f at import, as hosts' modules do

        assert hook_importer_for_test.f() == "patched" and seen == ["hook_target_for_test"]
        # a second owner's arrangement for a module already imported acts at once, and raises there
        with pytest.raises(RuntimeError, match="deferred"):
            on_import.arrange("other-owner", {"hook_target_for_test": _raise_deferred})
        assert on_import.finder("other-owner") is None
    finally:
        on_import.remove("test-owner")
        for name in ("hook_target_for_test", "hook_importer_for_test"):
            sys.modules.pop(name, None)
    assert on_import.finder("test-owner") is None


def _raise_deferred(module):
    raise RuntimeError("deferred")


def test_megatron_cpu_set_applies_and_restores_every_target():
    ps = megatron_cpu.build_patches()
    ps.check()
    present = {p.target: patches._resolve(p.module, p.attribute) for p in ps if p.check() is None}
    originals = {t: _static(o, a) for t, (o, a) in present.items()}
    ps.apply()
    ps.apply()
    assert ps.applied and len(present) >= 15
    assert [t for t, (o, a) in present.items() if _static(o, a) is originals[t]] == []
    skipped = {p.name for p in ps if p.skipped}
    # the patches for calls that appeared in 0.19 apply exactly on 0.19 (the installed wheels have no dev trees)
    new = {"cuda_current_stream", *megatron_cpu.NEW_IN_0_19}
    assert skipped == (set() if _mcore_version() >= Version("0.19.0rc0") else new), ps.describe()
    ps.undo()
    assert all(_static(o, a) is originals[t] for t, (o, a) in present.items())
    assert not any(p.skipped for p in ps)


def _fake_megatron_version(monkeypatch, version: str) -> None:
    monkeypatch.setattr(megatron_cpu, "imported_version",
                        lambda module, attribute, dist: ImportedVersion(version, f"{module}.{attribute} (test)"))


@pytest.mark.parametrize("version", ["0.21.0", "0.21.0rc1", "0.15.3"])
def test_megatron_cpu_refuses_an_unsupported_megatron(monkeypatch, version):
    _fake_megatron_version(monkeypatch, version)
    ps = megatron_cpu.build_patches()
    with pytest.raises(PatchError, match=rf"supports megatron-core>=0.16.0rc0,<0.21 .*but {version} is imported "
                                         r"\(megatron.core.package_info.__version__ \(test\)\)"):
        ps.apply()
    assert not any(p.applied for p in ps)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patch set is only applied without a GPU")
@pytest.mark.skipif(_mcore_version() >= Version("0.17"), reason="pairs a 0.16 dev version with 0.16 code")
def test_megatron_cpu_accepts_a_dev_build(monkeypatch):
    """slime's Megatron-LM commits report 0.16.0rc0: accepted, judged by their code (0.16's here)."""
    _fake_megatron_version(monkeypatch, "0.16.0rc0")
    ps = megatron_cpu.build_patches()
    ps.apply()
    try:
        assert ps.applied and {p.name for p in ps if p.skipped} == {"cuda_current_stream", *megatron_cpu.NEW_IN_0_19}
    finally:
        ps.undo()


@pytest.mark.skipif(_mcore_version() >= Version("0.19.0rc0"), reason="needs code older than 0.19")
def test_the_0_19_patches_are_required_from_0_19(monkeypatch):
    """A tree that says 0.19 but lacks 0.19's targets is refused, not silently half-patched."""
    _fake_megatron_version(monkeypatch, "0.19.0")
    with pytest.raises(PatchError, match=r"grad_(sync_stream|norm_group_flag).*(does not exist|no longer contains)"):
        megatron_cpu.build_patches().apply()


def test_a_0_19_patch_follows_the_code_of_an_older_dev_tree(monkeypatch, tmp_path):
    """Before 0.19 a patch for a 0.19 call is applied exactly when the imported code makes that call."""
    (tmp_path / "fake_bucket_group.py").write_text("import torch\n\n\n"
                                                 "def with_call():\n    return torch.cuda.current_stream()\n\n\n"
                                                 "def without_call():\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_bucket_group", raising=False)
    _fake_megatron_version(monkeypatch, "0.16.0rc0")
    call = "torch.cuda.current_stream()"
    assert megatron_cpu.code_has_call("fake_bucket_group", "with_call", call)() is None
    reason = megatron_cpu.code_has_call("fake_bucket_group", "without_call", call)()
    assert f"has no {call}" in reason and "0.16.0rc0" in reason
    assert "does not exist" in megatron_cpu.code_has_call("fake_bucket_group", "gone", call)()
    _fake_megatron_version(monkeypatch, "0.19.1")  # required from 0.19: the patch's own checks decide
    assert megatron_cpu.code_has_call("fake_bucket_group", "without_call", call)() is None


def test_every_patch_documents_target_and_versions():
    for p in megatron_cpu.build_patches():
        assert p.doc and p.tested and p.supported and p.distribution in ("megatron-core", "torch"), p.name
    assert "tested 0.16.1, 0.17.1, 0.18.2, 0.19.1, 0.19.2, 0.20.0" in megatron_cpu.build_patches().describe()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cuda_calls_answer_for_the_cpu_only_inside_the_context(cpu_patches):
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with megatron_cpu.cpu_device_context():
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.tensor([1.0], device=torch.cuda.current_device()).device.type == "cpu"
        t = torch.ones(3)
        assert t.cuda() is t and t.to("cuda").device.type == "cpu"
        with megatron_cpu.cpu_device_context():  # re-entrant
            assert megatron_cpu.in_cpu_device_context()
        assert megatron_cpu.in_cpu_device_context()
    assert not megatron_cpu.in_cpu_device_context()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_rng_tracker_forks_the_cpu_generator(cpu_patches):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    with pytest.raises(Exception, match="seed 7 already exists"):
        tracker.add("other", 7)
    torch.manual_seed(0)
    outside_before = torch.rand(1)
    torch.manual_seed(0)
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.rand(1), outside_before)  # the default stream continues where it was
    with tracker.fork():
        b = torch.rand(3)
    assert torch.equal(a, torch.rand(3, generator=torch.Generator().manual_seed(7)))  # seeded by add()
    assert not torch.equal(a, b)  # the tracked stream advanced


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_clip_grad_scales_fp32_grads_in_place(cpu_patches):
    from megatron.core.optimizer import optimizer as mopt

    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)
    mopt.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6)))
    mopt.clip_grad_by_total_norm_fp32([p], max_norm=10.0, total_norm=4.0)  # below the limit: untouched
    assert torch.allclose(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6)))


def test_apply_if_no_gpu_is_a_no_op_with_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_cpu.apply_if_no_gpu() is False
    assert not megatron_cpu.PATCHES.applied


SOURCE_TREE_PROBE = """
import warnings; warnings.simplefilter("ignore")
import megatron.core, megatron.core.package_info as info
from slime_ext.patches import PatchError, megatron_cpu
print("FILE", megatron.core.__file__)
found = megatron_cpu.megatron_core_version()
print("VERSION", found.version, "|", found.origin)
ps = megatron_cpu.build_patches()
ps.apply()
print("APPLIED", ps.applied)
ps.undo()
info.__version__ = "0.21.0"  # the same tree, were it a 0.21 checkout
try:
    megatron_cpu.build_patches().apply()
except PatchError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU patch set is only applied without a GPU")
def test_a_source_tree_on_pythonpath_is_judged_by_what_it_is(tmp_path):
    """A Megatron-LM checkout in front of the installed wheel (slime's set-up): its package_info decides, not pip."""
    import importlib.metadata
    import os
    import shutil
    import subprocess

    import megatron.core

    imported = Version(megatron_cpu.megatron_core_version().version)
    dev = f"{imported.major}.{imported.minor}.0rc0"  # a dev build of the imported code's release
    try:
        says = f"the installed megatron-core distribution says {importlib.metadata.version('megatron-core')}, " \
               f"the imported code wins"
    except importlib.metadata.PackageNotFoundError:  # this run imports a source tree itself
        says = "no megatron-core distribution is installed (a source tree)"
    tree = tmp_path / "Megatron-LM"
    shutil.copytree(Path(megatron.core.__file__).parent, tree / "megatron" / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tree / "megatron" / "core" / "package_info.py", "a") as f:
        f.write(f"\n__version__ = {dev!r}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
    out = subprocess.run([sys.executable, "-c", SOURCE_TREE_PROBE], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["FILE"].startswith(str(tree)), lines["FILE"]
    assert lines["VERSION"].startswith(f"{dev} | ") and str(tree) in lines["VERSION"]
    assert says in lines["VERSION"], lines["VERSION"]
    assert lines["APPLIED"] == "True"
    assert "supports megatron-core>=0.16.0rc0,<0.21" in lines["REFUSED"] and "but 0.21.0 is imported" \
        in lines["REFUSED"] and str(tree) in lines["REFUSED"]


# ---------------------------------------------------------------------------------------------------- megatron_cpu: Megatron-LM
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_returns_a_copy_inside_the_context(cpu_patches):
    """As for the CUDA tensor the code expects: train() keeps `v.cpu()` of the state dict as RL reference weights."""
    weight = torch.nn.Parameter(torch.ones(3))
    assert weight.cpu() is weight  # torch's own behaviour outside the context
    with megatron_cpu.cpu_device_context():
        reference = {k: v.cpu() for k, v in {"w": weight}.items()}
    assert reference["w"] is not weight and reference["w"].data_ptr() != weight.data_ptr()
    with torch.no_grad():
        weight.add_(1.0)  # a training step
    assert torch.equal(reference["w"], torch.ones(3))  # the reference stays what it was


def _fake_stream_api():
    return types.SimpleNamespace(Stream=lambda *a, **k: "cuda-stream", stream=lambda s: f"cuda-context({s})",
                                 current_stream=lambda device=None: "cuda-current")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_stream_api_answers_with_cpu_streams_only_inside_the_context():
    fake = _fake_stream_api()
    stream = megatron_cpu._stream_class(fake.Stream)
    context = megatron_cpu._stream_context(fake.stream)
    current = megatron_cpu._current_stream(fake.current_stream)
    assert (stream(), context("s"), current()) == ("cuda-stream", "cuda-context(s)", "cuda-current")
    with megatron_cpu.cpu_device_context():
        made = stream()
        assert isinstance(made, torch.cpu.Stream) and isinstance(current(), torch.cpu.Stream)
        made.wait_stream(current())  # what get_model does with them: no-ops
        with context(made):
            pass


def test_megatron_lm_set_documents_its_targets_and_needs_a_checkout():
    ps = megatron_cpu.build_megatron_lm_patches()
    names = {p.name for p in ps}
    assert {"mlm_cuda_stream", "mlm_cuda_stream_context", "mlm_cuda_current_stream"} <= names
    assert {entry[0] for entry in megatron_cpu.MEGATRON_LM_CONTEXT_WRAPPED} <= names
    for p in ps:
        assert p.doc and p.tested and p.supported, p.name
    try:
        import megatron.training.training  # noqa: F401 -- only in a Megatron-LM checkout
    except ImportError:
        with pytest.raises(PatchError, match=r"cannot import megatron\.training\.training"):
            ps.check()
    else:
        ps.check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_megatron_lm_current_stream_patch_steps_aside_for_the_core_one(monkeypatch, cpu_patches):
    """Both sets may wrap torch.cuda.current_stream; the Megatron-LM set skips it where the core set applied it
    (megatron-core 0.19+), so the two never stack."""
    monkeypatch.setattr(megatron_cpu, "PATCHES", cpu_patches)
    core = next(p for p in cpu_patches if p.name == "cuda_current_stream")
    reason = megatron_cpu._core_patch_applied("cuda_current_stream")()
    assert core.applied == (_mcore_version() >= Version("0.19.0rc0"))
    assert (reason is not None) == core.applied, reason


def test_a_pending_send_keeps_the_sent_storage_alive():
    """Megatron-LM's training swaps a sent output's .data for a 1-element tensor right after the send
    (deallocate_pipeline_outputs); the pending send's alias keeps the storage and its contents."""
    out = torch.arange(6.0)
    pending = megatron_cpu._PendingSend(types.SimpleNamespace(wait=lambda: "done"), out.detach())
    ptr = out.data_ptr()
    out.data = torch.empty((1,))  # schedules.deallocate_output_tensor
    assert pending.storage.data_ptr() == ptr and torch.equal(pending.storage, torch.arange(6.0))
    assert pending.wait() == "done" and pending.storage is None


def test_overlapped_p2p_send_handles_keep_the_sent_storage():
    """The interleaved schedule's overlapped p2p (``_p2p_ops``): each send handle it returns holds the sent tensor's
    storage until waited on (Megatron frees a sent output's storage right after posting the send); receives and the
    handles' results are upstream's own."""
    from megatron.core.pipeline_parallel import p2p_communication

    posted = {}

    def fake_p2p_ops(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                     prev_pipeline_rank, next_pipeline_rank):
        reqs = {}
        if tensor_send_next is not None:
            reqs["send_next"] = types.SimpleNamespace(wait=lambda: "sent next")
        if tensor_recv_prev is not None:
            reqs["recv_prev"] = posted["recv"] = types.SimpleNamespace(wait=lambda: "received")
        return reqs

    wrapped = megatron_cpu._p2p_ops(fake_p2p_ops)
    out = torch.arange(4.0)
    ptr = out.data_ptr()
    reqs = wrapped(tensor_send_prev=None, tensor_recv_prev=torch.empty(4), tensor_send_next=out,
                   tensor_recv_next=None, group=None, prev_pipeline_rank=0, next_pipeline_rank=1)
    out.data = torch.empty(1)  # megatron's deallocate_output_tensor
    assert reqs["recv_prev"] is posted["recv"]
    assert reqs["send_next"].storage.data_ptr() == ptr
    assert torch.equal(reqs["send_next"].storage, torch.arange(4.0))
    assert reqs["send_next"].wait() == "sent next" and reqs["send_next"].storage is None
    assert "p2p_ops" in {p.name for p in megatron_cpu.build_patches()}
    assert hasattr(p2p_communication, "_p2p_ops")
