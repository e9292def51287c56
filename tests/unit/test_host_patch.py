"""patches.host_slime against the slime-shaped legacy backend of this repo: swap, restore, refuse mismatches."""

from __future__ import annotations

import sys
import types

import pytest

from slime_ext.patches import PatchError, host_slime
from slime_ext.training import data, legacy_backend, lr


@pytest.fixture(autouse=True)
def _restore():
    yield
    host_slime.undo()


def test_rollout_flag_swaps_the_backend_and_legacy_restores_it():
    originals = (legacy_backend.get_data_iterator, legacy_backend.DataIterator, legacy_backend.step_lr_scheduler)
    assert host_slime.configure("rollout") is True
    assert host_slime.configure("rollout") is True  # idempotent
    assert legacy_backend.get_data_iterator is host_slime.get_data_iterator
    assert legacy_backend.DataIterator is data.DataIterator
    assert legacy_backend.step_lr_scheduler is lr.step_lr_scheduler
    assert host_slime.configure("legacy") is False
    assert (legacy_backend.get_data_iterator, legacy_backend.DataIterator, legacy_backend.step_lr_scheduler) \
        == originals
    assert host_slime.configure("legacy") is False


def test_swapped_functions_follow_the_schedule():
    host_slime.configure("rollout")
    rollout_data = {
        "tokens": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "total_lengths": [3, 2, 4], "response_lengths": [1, 1, 2],
        "loss_masks": [[1], [1], [1, 0]], "advantages": [0.5, -1.0, 2.0],
        "micro_batch_indices": [[0, 1], [2]], "num_microbatches": [2], "samples_per_step": [7],
    }
    iterators, nmb = legacy_backend.get_data_iterator(None, None, rollout_data)
    assert nmb == [2] and len(iterators) == 1 and isinstance(iterators[0], data.DataIterator)
    assert iterators[0].get_next(["total_lengths"]) == {"total_lengths": [3, 2]}

    class Scheduler:
        steps = []

        def step(self, increment):
            self.steps.append(increment)

    sched = Scheduler()
    assert legacy_backend.step_lr_scheduler(types.SimpleNamespace(global_batch_size=64), sched, rollout_data, 0) == 7
    host_slime.configure("legacy")
    legacy_backend.step_lr_scheduler(types.SimpleNamespace(global_batch_size=64), sched, rollout_data, 0)
    assert sched.steps == [7, 64]


@pytest.fixture
def fake_host():
    mod = types.ModuleType("fake_host")
    mod.get_data_iterator = lambda args, model, rollout_data: None
    mod.DataIterator = object
    mod.step_lr_scheduler = lambda *a: None
    sys.modules["fake_host"] = mod
    yield mod
    host_slime._PATCHES.pop("fake_host", None)
    del sys.modules["fake_host"]


def test_a_host_with_another_api_version_is_refused(fake_host):
    fake_host.HOST_API_VERSION = "2.0"
    with pytest.raises(PatchError, match=r"supports fake_host.HOST_API_VERSION>=1.0,<2 .* but 2.0 is installed"):
        host_slime.configure("rollout", host_module="fake_host")
    assert fake_host.DataIterator is object


def test_a_host_without_marker_or_target_is_refused(fake_host):
    with pytest.raises(PatchError, match="no HOST_API_VERSION marker"):
        host_slime.configure("rollout", host_module="fake_host")
    fake_host.HOST_API_VERSION = "1.0"
    del fake_host.step_lr_scheduler
    with pytest.raises(PatchError, match="step_lr_scheduler does not exist"):
        host_slime.configure("rollout", host_module="fake_host")
    assert fake_host.DataIterator is object  # nothing half-applied


def test_bad_flag_value():
    with pytest.raises(PatchError, match="must be 'rollout' or 'legacy'"):
        host_slime.configure("both")
