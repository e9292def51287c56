"""The Patch framework and the megatron-core CPU patch set: apply, undo, idempotence, loud mismatches."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import slime_ext.patches as patches
from slime_ext.patches import Patch, PatchError, PatchSet, megatron_cpu, source_contains


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


def _patch(attribute="greet", supported=">=1.0,<2", make=None, expect=None, version=None):
    return Patch(name="p", module="fake_target", attribute=attribute,
                 make=make or (lambda orig: lambda *a: "patched " + orig(*a)), distribution="fake",
                 supported=supported, tested=("1.2.0",), expect=expect,
                 version=version or (lambda: sys.modules["fake_target"].VERSION))


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
    target_module.VERSION = "2.0.0"
    with pytest.raises(PatchError, match=r"supports fake>=1.0,<2 \(tested: 1.2.0\) but 2.0.0 is installed"):
        _patch().apply()
    assert target_module.greet("x") == "hello x"


def test_missing_target_and_unexpected_source_are_refused(target_module):
    with pytest.raises(PatchError, match="does not exist"):
        _patch("nope").apply()
    with pytest.raises(PatchError, match="no longer contains"):
        _patch(expect=source_contains("torch.cuda.synchronize()")).apply()
    assert target_module.greet("x") == "hello x"
    _patch(expect=source_contains("hello")).apply()


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


def test_megatron_cpu_set_applies_and_restores_every_target():
    ps = megatron_cpu.build_patches()
    before = {p.target: patches._resolve(p.module, p.attribute) for p in ps}
    originals = {t: (o.__dict__[a] if isinstance(o, type) else getattr(o, a)) for t, (o, a) in before.items()}
    ps.apply()
    ps.apply()
    assert ps.applied and len(ps.patches) >= 10
    changed = [t for t, (o, a) in before.items()
               if (o.__dict__[a] if isinstance(o, type) else getattr(o, a)) is originals[t]]
    assert changed == []
    ps.undo()
    assert all((o.__dict__[a] if isinstance(o, type) else getattr(o, a)) is originals[t]
               for t, (o, a) in before.items())


def test_megatron_cpu_refuses_an_unsupported_megatron(monkeypatch):
    monkeypatch.setattr(patches, "installed_version", lambda dist: "0.17.0" if dist == "megatron-core" else "2.13.0")
    ps = megatron_cpu.build_patches()
    with pytest.raises(PatchError, match=r"megatron-core>=0.16,<0.17.*0.17.0 is installed"):
        ps.apply()
    assert not any(p.applied for p in ps)


def test_every_patch_documents_target_and_versions():
    for p in megatron_cpu.build_patches():
        assert p.doc and p.tested and p.supported and p.distribution in ("megatron-core", "torch"), p.name
    assert "tested 0.16.1" in megatron_cpu.build_patches().describe()


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
