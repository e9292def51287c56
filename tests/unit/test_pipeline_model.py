"""The pipeline model (slime_ext.schedule.pipeline): hand-computed cases, megatron-core's order of operations, an
independent event simulation, and the lower bound against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from slime_ext.schedule import ParallelConfig, ScheduleError
from slime_ext.schedule.pipeline import (PipelineSpec, bubble_fraction, pipeline_lower_bound, pipeline_makespan,
                                         pipeline_timeline)


# ---------------------------------------------------------------------------------------------------- configs
def test_parallel_config_gains_pp_size_and_stays_backwards_compatible():
    assert ParallelConfig(dp_size=2).pp_size == 1
    assert ParallelConfig(dp_size=2) == ParallelConfig.from_megatron(2)  # configs that plan alike compare equal
    assert ParallelConfig.from_megatron(8, pipeline_model_parallel_size=4).pp_size == 4
    assert ParallelConfig.from_megatron(8, pipeline_model_parallel_size=None).pp_size == 1
    assert ParallelConfig.from_dict({"dp_size": 2, "pp_size": 4}).pp_size == 4
    assert ParallelConfig.from_dict({"dp_size": 2}).pp_size == 1  # slime's dict without it
    assert ParallelConfig(dp_size=2, pp_size=4).to_dict()["pp_size"] == 4
    cfg = ParallelConfig.from_megatron(4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ScheduleError, match="pp_size"):
        ParallelConfig(dp_size=2, pp_size=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp_size=0), "pp_size"),
    (dict(pp_size=2, vpp_size=0), "vpp_size"),
    (dict(pp_size=2, p2p_s=-1.0), "p2p_s"),
    (dict(pp_size=2, p2p_s=float("nan")), "p2p_s"),
    (dict(pp_size=2, overlap_p2p_comm="yes"), "overlap_p2p_comm"),
    (dict(pp_size=2, microbatch_group_size_per_vp_stage=0), "microbatch_group_size_per_vp_stage"),
])
def test_spec_refuses_bad_fields_by_name(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        PipelineSpec(**kwargs)


def test_costs_are_checked():
    spec = PipelineSpec(2)
    with pytest.raises(ScheduleError, match="same shape"):
        pipeline_makespan([1.0, 2.0], [1.0], spec)
    with pytest.raises(ScheduleError, match="fwd holds a negative"):
        pipeline_makespan([-1.0], [1.0], spec)
    with pytest.raises(ScheduleError, match="bwd holds a negative"):
        pipeline_makespan([1.0], [float("inf")], spec)
    with pytest.raises(ScheduleError, match="no micro-batches"):
        pipeline_makespan(np.zeros(0), np.zeros(0), spec)


# ---------------------------------------------------------------------------------------------------- 1F1B by hand
def test_equal_costs_give_the_textbook_makespan():
    # (M + pp - 1) * (f + b) for equal micro-batches and free p2p
    for pp in (1, 2, 4, 8):
        for m in (1, 3, 8, 16):
            assert pipeline_makespan([1.0] * m, [2.0] * m, PipelineSpec(pp)) == pytest.approx((m + pp - 1) * 3.0)


def test_pp1_is_the_sum():
    f = np.array([1.0, 4.0, 2.0])
    assert pipeline_makespan(f, 2 * f, PipelineSpec(1)) == pytest.approx(21.0)
    assert bubble_fraction(f, 2 * f, PipelineSpec(1)) == pytest.approx(0.0)


def test_two_stage_timeline_by_hand():
    # stage 1 (last) runs F0 B0 F1 B1 F2 B2; stage 0 warms up with F0, then F1 B0 F2 B1, cools down with B2
    tl = pipeline_timeline([1, 2, 3], [2, 4, 6], PipelineSpec(2))
    assert tl[0] == [("F", 0, 0, 0, 1), ("F", 1, 0, 1, 3), ("B", 0, 0, 4, 6), ("F", 2, 0, 6, 9),
                     ("B", 1, 0, 10, 14), ("B", 2, 0, 19, 25)]
    assert tl[1] == [("F", 0, 0, 1, 2), ("B", 0, 0, 2, 4), ("F", 1, 0, 4, 6), ("B", 1, 0, 6, 10),
                     ("F", 2, 0, 10, 13), ("B", 2, 0, 13, 19)]
    assert pipeline_makespan([1, 2, 3], [2, 4, 6], PipelineSpec(2)) == 25


def test_vectorised_rows_equal_single_rows():
    rng = np.random.default_rng(0)
    f = rng.random((5, 7))
    spec = PipelineSpec(3, p2p_s=0.05)
    rows = pipeline_makespan(f, 2 * f, spec)
    assert rows.shape == (5,)
    for r in range(5):
        assert rows[r] == pytest.approx(pipeline_makespan(f[r], 2 * f[r], spec))
