"""The benchmarks' workloads, in one place: every bench draws its sample lengths here, by a distribution's name, a
size and a seed, so one seed gives one rollout in every bench.

* :func:`make_lengths` -- ``n`` total lengths (prompt + response) of a named distribution, reproducible from a seed;
* :class:`Workload` -- one seeded rollout (distribution, size, seed; optionally scaled to a small model's context);
  the named sets below are the ones the benches run;
* :class:`Case`, :data:`CASES`, :data:`FLAG_SETS` -- the planning cases of ``bench.run`` and the pinned plans of
  ``bench.plan_digest``;
* :data:`SCHEMES` -- the schemes the training benches compare (``bench.train_step``, ``bench.gpu_replay``);
* :data:`MODEL_DIMS` -- the Qwen3-8B-like model the lengths are priced for.

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
* ``bimodal``    -- 80% short, 20% long (our choice): every sample has a prompt ~ U[100, 1000]; a short one a
                    response ~ lognormal(mu=6.5, sigma=0.5) (~700 tokens), a long one a response ~ U[8000, 15000].
                    Which samples are long is drawn per sample (probability 0.2).
* ``bimodal-uniform`` -- 80% short, 20% long, both uniform: prompt ~ U[100, 1500]; a short response ~ U[100, 1000],
                    a long one ~ U[6000, 14000]. The "bimodal" rollout shape of the pipeline-model, verl and
                    Megatron-RL benches (:data:`ROLLOUT_SHAPES`).
* ``reasoning``  -- reasoning-like: prompt ~ U[100, 1000] + response ~ lognormal(mu=8.7, sigma=0.6) (around 6k
                    tokens) capped at 32000: short prompts, long chains of thought.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


# ---------------------------------------------------------------------------------------------------- distributions
def _ints(x: np.ndarray) -> np.ndarray:
    return np.maximum(1, np.rint(x)).astype(np.int64)


def _rl(rng: np.random.Generator, n: int) -> np.ndarray:
    prompt = rng.integers(100, 1500, size=n, endpoint=True)
    response = np.minimum(_ints(rng.lognormal(mean=7.5, sigma=1.0, size=n)), 16000)
    return prompt + response


def _heavy(rng: np.random.Generator, n: int) -> np.ndarray:
    prompt = rng.integers(50, 600, size=n, endpoint=True)
    response = np.minimum(_ints(300.0 * rng.pareto(1.2, size=n)), 30000)
    return prompt + response


def _bimodal(rng: np.random.Generator, n: int) -> np.ndarray:
    prompt = rng.integers(100, 1000, size=n, endpoint=True)
    long = rng.random(n) < 0.2
    short_response = _ints(rng.lognormal(mean=6.5, sigma=0.5, size=n))
    long_response = rng.integers(8000, 15000, size=n, endpoint=True)
    return prompt + np.where(long, long_response, short_response)


def _bimodal_uniform(rng: np.random.Generator, n: int) -> np.ndarray:
    prompt = rng.integers(100, 1500, size=n, endpoint=True)
    long = rng.random(n) < 0.2
    response = np.where(long, rng.integers(6000, 14000, size=n, endpoint=True),
                        rng.integers(100, 1000, size=n, endpoint=True))
    return prompt + response


def _uniform(rng: np.random.Generator, n: int) -> np.ndarray:
    prompt = rng.integers(200, 300, size=n, endpoint=True)
    response = rng.integers(700, 800, size=n, endpoint=True)
    return prompt + response


def _reasoning(rng: np.random.Generator, n: int) -> np.ndarray:
    prompt = rng.integers(100, 1000, size=n, endpoint=True)
    response = np.minimum(np.rint(rng.lognormal(mean=8.7, sigma=0.6, size=n)), 32000)
    return prompt + response


#: distribution name -> ``draw(rng, n)``: the lengths (module docstring)
DISTRIBUTIONS: dict[str, Callable[[np.random.Generator, int], np.ndarray]] = {
    "rl": _rl, "heavy": _heavy, "bimodal": _bimodal, "bimodal-uniform": _bimodal_uniform, "uniform": _uniform,
    "reasoning": _reasoning,
}


def make_lengths(dist: str, n: int, seed: int) -> np.ndarray:
    """``n`` total lengths (prompt + response) from distribution ``dist``, reproducible from ``seed``."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}; use one of {', '.join(map(repr, DISTRIBUTIONS))}")
    return DISTRIBUTIONS[dist](np.random.default_rng(seed), n).astype(np.int64)


# ---------------------------------------------------------------------------------------------------- workloads
#: a scaled length is clipped to at least this many tokens
MIN_SCALED_LENGTH = 8


@dataclass(frozen=True)
class Workload:
    """One seeded rollout: ``n`` lengths of distribution ``dist`` from ``seed``, planned under ``cap`` tokens per
    GPU. ``scale`` and ``max_len`` shrink the lengths for a small model: each length times ``scale``, rounded and
    clipped to ``[MIN_SCALED_LENGTH, max_len]`` (the real-training benches, whose tiny GPT has a short context)."""

    name: str
    dist: str
    n: int
    seed: int
    cap: int = MAX_TOKENS_PER_GPU
    scale: float = 1.0
    max_len: int | None = None

    def lengths(self) -> np.ndarray:
        raw = make_lengths(self.dist, self.n, self.seed)
        if self.scale == 1.0 and self.max_len is None:
            return raw
        return np.clip(np.rint(raw * self.scale), MIN_SCALED_LENGTH, self.max_len).astype(np.int64)


#: the three rollout shapes of the pipeline-model, verl and Megatron-RL benches: label -> distribution
ROLLOUT_SHAPES = {"rl-like": "rl", "bimodal": "bimodal-uniform", "long tail": "heavy"}

#: ``bench.pipeline``'s sleep replay (and ``bench.pipeline_stages``): one rollout = one step at dp 8
REPLAY_WORKLOADS = {
    "rl-like": Workload("rl-like", "rl", 256, 151),
    "bimodal": Workload("bimodal", "bimodal", 256, 152),
    "long-tail": Workload("long-tail", "heavy", 256, 153),
}
REPLAY_QUICK_WORKLOADS = {"rl-like": Workload("rl-like", "rl", 128, 151)}

#: ``bench.train_step``'s real training of the tiny GPT (full run, ``--quick``)
TRAIN_STEP_WORKLOADS = (Workload("rl", "rl", n=32, seed=11, cap=1024, scale=1 / 12, max_len=1024),
                        Workload("heavy", "heavy", n=64, seed=12, cap=1024, scale=1 / 10, max_len=1024))
TRAIN_STEP_QUICK_WORKLOADS = (Workload("heavy-small", "heavy", n=32, seed=13, cap=512, scale=1 / 16, max_len=512),)

#: ``bench.pipeline --real``: the tiny GPT at DP = 1 x PP = 2
REAL_PIPELINE_WORKLOADS = (Workload("rl", "rl", n=32, seed=21, cap=512, scale=1 / 24, max_len=512),
                           Workload("bimodal", "bimodal", n=32, seed=22, cap=512, scale=1 / 24, max_len=512))

#: ``bench.gpu_replay``: distribution -> seed (size, scale and cap follow the device)
GPU_REPLAY_SEEDS = {"rl": 21, "heavy": 22, "reasoning": 23}


# ---------------------------------------------------------------------------------------------------- planning cases
@dataclass(frozen=True)
class Case:
    """One rollout of ``n`` samples planned at ``dp_size`` (``bench.run``, ``bench.plan_digest``): one rollout id
    per sample (``rollout_ids = range(n)``), ``cp_size = 1``, no VPP; ``global_batch_size`` is ``n`` (one step)
    unless stated."""

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

# ---------------------------------------------------------------------------------------------------- schemes
#: what the training benches compare: slime's legacy split, upstream's reference, and ours under three flag sets
SCHEMES = ("legacy", "reference", "ours:strided", "ours:balance_data", "ours:balance_by_flops")
#: the scheme every ratio is taken against
OURS = "ours:balance_by_flops"
#: our schemes' (balance_data, balance_by_flops)
OURS_FLAGS = {"ours:strided": (False, False), "ours:balance_data": (True, False), "ours:balance_by_flops": (True, True)}
