"""Seeded benchmark workloads (issue 2): sample lengths, the parallel/batch layout and the model they are planned for.

Every case is one rollout: ``n`` samples, one rollout id per sample (``rollout_ids = range(n)``), planned with
``max_tokens_per_gpu = 16384``, ``cp_size = 1``, no VPP. ``global_batch_size`` is ``n`` (one step) unless stated.

Distributions (all lengths are total tokens = prompt + response, integers >= 1):

* ``rl``         -- synthetic RL: prompt ~ U[100, 1500] + response ~ lognormal(mu=7.5, sigma=1.0) capped at 16000.
                    Up to 17500 tokens, so ~1% of the samples are longer than the cap and sit alone.
* ``heavy``      -- heavy tail: prompt ~ U[50, 600] + response ~ 300 * Pareto(alpha=1.2) capped at 30000, with
                    numpy's ``Generator.pareto`` (Pareto II / Lomax, support [0, inf)). This reproduces the issue's
                    balance bound of ~1.08-1.2 per step; the classical Pareto (``1 + pareto``, response >= 300)
                    has a larger mean and a bound of ~1.0.
* ``uniform``    -- near-uniform (our choice): prompt ~ U[200, 300] + response ~ U[700, 800], i.e. 900..1100 tokens,
                    16-18 samples per micro-batch. The SFT-like regime where packing is easy and the cost model is
                    nearly linear; it checks that nothing regresses when there is little to balance.
* ``bimodal``    -- 80% short, 20% long (our choice, issue 15): every sample has a prompt ~ U[100, 1000]; a short
                    one a response ~ lognormal(mu=6.5, sigma=0.5) (~700 tokens), a long one a response ~ U[8000, 15000].
                    Which samples are long is drawn per sample (probability 0.2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOKENS_PER_GPU = 16384

#: Qwen3-8B-like dense model; the same dims feed our ``CostModel`` and the baselines' ``calculate_fwd_flops``.
MODEL_DIMS = dict(
    hidden_size=4096,
    num_layers=36,
    num_attention_heads=32,
    num_query_groups=8,
    kv_channels=128,
    ffn_hidden_size=12288,
    vocab_size=151936,
    swiglu=True,
)


@dataclass(frozen=True)
class Case:
    name: str
    dist: str
    n: int
    dp_size: int
    global_batch_size: int
    seed: int
    max_tokens_per_gpu: int = MAX_TOKENS_PER_GPU
    cp_size: int = 1

    @property
    def cap(self) -> int:
        return self.max_tokens_per_gpu * self.cp_size

    @property
    def num_steps(self) -> int:
        return self.n // self.global_batch_size


def _ints(x: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(x)).astype(np.int64)


def make_lengths(dist: str, n: int, seed: int) -> np.ndarray:
    """``n`` total lengths (prompt + response) from distribution ``dist``, reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    if dist == "rl":
        prompt = rng.integers(100, 1500, size=n, endpoint=True)
        response = np.minimum(_ints(rng.lognormal(mean=7.5, sigma=1.0, size=n)), 16000)
    elif dist == "heavy":
        prompt = rng.integers(50, 600, size=n, endpoint=True)
        response = np.minimum(_ints(300.0 * rng.pareto(1.2, size=n)), 30000)
    elif dist == "bimodal":
        prompt = rng.integers(100, 1000, size=n, endpoint=True)
        long = rng.random(n) < 0.2
        short_response = _ints(rng.lognormal(mean=6.5, sigma=0.5, size=n))
        long_response = rng.integers(8000, 15000, size=n, endpoint=True)
        response = np.where(long, long_response, short_response)
    elif dist == "uniform":
        prompt = rng.integers(200, 300, size=n, endpoint=True)
        response = rng.integers(700, 800, size=n, endpoint=True)
    else:
        raise ValueError(f"unknown distribution {dist!r}; use 'rl', 'heavy', 'bimodal' or 'uniform'")
    return (prompt + response).astype(np.int64)


CASES = [
    Case("rl-1k-dp8", "rl", n=1024, dp_size=8, global_batch_size=1024, seed=1),
    Case("rl-4k-dp32", "rl", n=4096, dp_size=32, global_batch_size=4096, seed=2),
    Case("rl-16k-dp64-gbs4k", "rl", n=16384, dp_size=64, global_batch_size=4096, seed=3),
    Case("rl-16k-dp128", "rl", n=16384, dp_size=128, global_batch_size=16384, seed=4),
    Case("heavy-4k-dp32-gbs1k", "heavy", n=4096, dp_size=32, global_batch_size=1024, seed=5),
    Case("uniform-4k-dp32", "uniform", n=4096, dp_size=32, global_batch_size=4096, seed=6),
]

#: flag combinations: (label, balance_data, balance_by_flops)
FLAG_SETS = [
    ("strided", False, False),
    ("balance_data", True, False),
    ("balance_by_flops", False, True),
    ("both", True, True),
]
