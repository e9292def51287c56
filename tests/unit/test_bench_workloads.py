"""The benchmarks' one workload registry (:mod:`bench.workloads`): a distribution's name, a size and a seed give the
same lengths in every bench and every version (the pinned plans and the docs' figures depend on them)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workloads import DISTRIBUTIONS, REPLAY_WORKLOADS, ROLLOUT_SHAPES, Workload, make_lengths

#: the first six lengths of seed 1, recorded when the generators were gathered into the registry (each matched the
#: generator it replaced, bench by bench)
PINNED = {
    "rl": [1253, 5288, 3982, 2488, 3381, 2904],
    "heavy": [26468, 439, 496, 1617, 224, 304],
    "bimodal": [1297, 1236, 1654, 1416, 744, 752],
    "bimodal-uniform": [1598, 1214, 1664, 2241, 359, 674],
    "uniform": [1030, 1046, 1001, 1026, 990, 956],
    "reasoning": [3273, 10895, 8627, 5306, 8638, 7700],
}


def test_every_distribution_draws_its_pinned_lengths():
    assert sorted(DISTRIBUTIONS) == sorted(PINNED)
    for dist, first in PINNED.items():
        lengths = make_lengths(dist, 6, 1)
        assert lengths.dtype == np.int64 and lengths.tolist() == first, dist
        assert make_lengths(dist, 6, 2).tolist() != first, dist  # the seed matters


def test_a_named_set_only_names_registered_distributions():
    assert set(ROLLOUT_SHAPES.values()) <= set(DISTRIBUTIONS)
    assert all(w.dist in DISTRIBUTIONS for w in REPLAY_WORKLOADS.values())


def test_a_scaled_workload_rounds_and_clips_the_registry_lengths():
    w = Workload("w", "heavy", 6, 1, cap=512, scale=1 / 16, max_len=512)
    # 26468 / 16 is clipped to max_len; 224 / 16 = 14; every length at least MIN_SCALED_LENGTH
    assert w.lengths().tolist() == [512, 27, 31, 101, 14, 19]
    assert Workload("w", "heavy", 6, 1).lengths().tolist() == PINNED["heavy"]  # unscaled: the registry's own


def test_an_unknown_distribution_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown distribution 'lognormal'; use one of 'rl', 'heavy'"):
        make_lengths("lognormal", 4, 1)
