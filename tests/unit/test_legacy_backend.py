"""The slime-shaped legacy backend: first-fit counts, all-reduce MAX, VPP rounding, KK without a cap, LR by gbs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from slime_ext import baselines  # upstream's loops, spelled out: the oracle
from slime_ext.training import legacy_backend as lb


def test_minimum_num_micro_batch_size_is_upstream_first_fit():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 40))]
        cap = rng.randint(30, 200)
        assert lb.get_minimum_num_micro_batch_size(lengths, cap) == baselines.get_minimum_num_micro_batch_size(lengths, cap)


def test_data_iterator_static_slices_and_indices():
    data = {"x": list(range(6))}
    it = lb.DataIterator(data, micro_batch_size=2)
    assert it.peek(2) == [[0, 1], [2, 3]]
    assert [it.get_next(["x"])["x"] for _ in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(lb.LegacyScheduleError, match="offset 6"):
        it.get_next(["x"])
    it = lb.DataIterator(data, micro_batch_indices=[[5, 0], [1]])
    assert it.get_next(["x", "y"]) == {"x": [5, 0], "y": None}
    with pytest.raises(lb.LegacyScheduleError, match="exactly one of"):
        lb.DataIterator(data)


@pytest.fixture
def fake_parallel(monkeypatch):
    """dp=2, no real process group: the peer rank's first-fit counts come from ``peer_counts``."""
    state = SimpleNamespace(dp=2, vpp=1, group=1, peer_counts=None)
    monkeypatch.setattr(lb, "_parallel_sizes", lambda model: (state.dp, None, state.vpp, state.group, 1))

    def all_reduce(tensor, op=None, group=None):
        tensor.copy_(torch.maximum(tensor, torch.tensor(state.peer_counts, dtype=tensor.dtype)))

    monkeypatch.setattr(lb.dist, "all_reduce", all_reduce)
    return state


def _data(lengths):
    return {"total_lengths": list(lengths)}


def test_dynamic_counts_take_the_dp_max_and_kk_fills_them_without_a_cap(fake_parallel):
    args = SimpleNamespace(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=50,
                           micro_batch_size=None)
    lengths = [40, 30, 20, 10, 45, 5, 5, 5]  # steps of 4 local samples: first fit needs 2 and 2 bins
    fake_parallel.peer_counts = [3, 1]  # the other rank needs 3 in step 0
    iterators, nmb = lb.get_data_iterator(args, None, _data(lengths))
    assert nmb == [3, 2]
    mbs = iterators[0].micro_batch_indices
    assert len(mbs) == 5 and sorted(i for mb in mbs[:3] for i in mb) == [0, 1, 2, 3]
    assert sorted(i for mb in mbs[3:] for i in mb) == [4, 5, 6, 7]
    fake_parallel.peer_counts = [1, 1]
    _, nmb = lb.get_data_iterator(args, None, _data([30, 30, 30, 30, 1, 1, 1, 1]))
    assert nmb == [4, 1]  # no two 30-token samples share a 50-token bin


def test_vpp_rounds_up_to_the_micro_batch_group(fake_parallel):
    fake_parallel.vpp, fake_parallel.group, fake_parallel.peer_counts = 2, 2, [1]
    args = SimpleNamespace(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=100,
                           micro_batch_size=None)
    iterators, nmb = lb.get_data_iterator(args, None, _data([10, 20, 30, 15]))
    assert nmb == [2] and len(iterators) == 2  # one bin by first fit, rounded up to the group of 2


def test_static_counts_and_loud_errors(fake_parallel):
    args = SimpleNamespace(global_batch_size=8, use_dynamic_batch_size=False, micro_batch_size=2,
                           max_tokens_per_gpu=None)
    iterators, nmb = lb.get_data_iterator(args, None, _data([5] * 8))
    assert nmb == [2, 2] and iterators[0].micro_batch_size == 2
    with pytest.raises(lb.LegacyScheduleError, match="would drop 1 samples"):
        lb.get_data_iterator(args, None, _data([5] * 9))
    with pytest.raises(lb.LegacyScheduleError, match="multiple of dp_size=2"):
        lb.get_data_iterator(SimpleNamespace(**{**vars(args), "global_batch_size": 7}), None, _data([5] * 8))
    fake_parallel.peer_counts = [5]
    dyn = SimpleNamespace(global_batch_size=8, use_dynamic_batch_size=True, max_tokens_per_gpu=100,
                          micro_batch_size=None)
    with pytest.raises(lb.LegacyScheduleError, match="5 micro-batches .* only 4 samples"):
        lb.get_data_iterator(dyn, None, _data([5] * 4))


def test_lr_steps_by_the_configured_global_batch_size():
    calls = []
    sched = SimpleNamespace(step=lambda increment: calls.append(increment))
    assert lb.step_lr_scheduler(SimpleNamespace(global_batch_size=32), sched, {"samples_per_step": [7]}, 0) == 32
    assert calls == [32]
