"""Estimated forward FLOPs per sample from the model dims, ``cost(L) = linear * L + quadratic * L**2``: projections,
MLP (dense or MoE) and LM head linear, causal self-attention quadratic; without dims, tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import ScheduleError
from .profile import CostProfile
from .validate import MAX_MODEL_DIM, check_bool, check_coefficients, check_instance, check_int, is_int, read_arg, show


def _dim(default: Any = dataclasses.MISSING, help: str = "", kind: str = "int") -> Any:
    """A model dim: its default, its ``--help`` line and its CLI kind (``int``, ``bool``, or ``freq``)."""
    return dataclasses.field(default=default, metadata={"help": help, "kind": kind})


@dataclass(frozen=True)
class CostModel:
    """Transformer dims under Megatron's argument names (a missing optional dim takes Megatron's default)."""

    hidden_size: int = _dim()
    num_layers: int = _dim()
    num_attention_heads: int = _dim()
    num_query_groups: int | None = _dim(None, "GQA groups (default: heads)")
    kv_channels: int | None = _dim(None, "default: hidden / heads")
    ffn_hidden_size: int | None = _dim(None, "default: 4 * hidden")
    vocab_size: int = _dim(0, "LM head (default 0: not counted)")
    num_experts: int | None = _dim(None, "MoE experts")
    moe_ffn_hidden_size: int | None = _dim(None, "default: ffn_hidden_size")
    moe_router_topk: int = _dim(2, "default 2")
    moe_shared_expert_intermediate_size: int | None = _dim(None)
    moe_layer_freq: int | tuple[int, ...] = _dim(
        1, "int k (every k-th layer is MoE) or a list of 0/1 per layer, e.g. [0,1,1]", kind="freq")
    swiglu: bool = _dim(False, "gated (SwiGLU) MLP: three matmuls (default off, as Megatron)", kind="bool")

    def __post_init__(self) -> None:
        def check(name: str, fix: str, minimum: int = 1) -> None:  # stored back as a plain int
            object.__setattr__(self, name, check_int(f"CostModel.{name}", getattr(self, name), minimum=minimum,
                                                     maximum=MAX_MODEL_DIM, fix=fix))

        for name in REQUIRED_DIMS:
            check(name, f"pass the model's --{name.replace('_', '-')}")
        for name in OPTIONAL_DIMS:
            if getattr(self, name) is not None:
                check(name, "give a positive size or leave it unset (None) for Megatron's default")
        if self.kv_channels is None and self.num_attention_heads > self.hidden_size:
            raise ScheduleError(f"CostModel.num_attention_heads = {self.num_attention_heads} exceeds hidden_size = "
                                f"{self.hidden_size}: the default kv_channels = hidden_size // num_attention_heads "
                                f"would be 0 (no attention FLOPs); pass kv_channels or check the dims")
        check("vocab_size", "give the (padded) vocabulary size, or 0 to leave the LM head out", minimum=0)
        check("moe_router_topk", "give the experts routed per token (>= 1)")
        object.__setattr__(self, "swiglu", check_bool("CostModel.swiglu", self.swiglu))
        freq = self.moe_layer_freq
        if not isinstance(freq, (list, tuple, np.ndarray)):
            check("moe_layer_freq", "give k >= 1 (every k-th layer is MoE) or a list of 0/1 per layer, "
                                    "e.g. [0, 1, 1, 1]")
        else:
            entries = list(freq.tolist() if isinstance(freq, np.ndarray) else freq)
            for i, f in enumerate(entries):
                if not is_int(f) or int(f) not in (0, 1):
                    raise ScheduleError(f"CostModel.moe_layer_freq[{i}] = {show(f)}; a per-layer moe_layer_freq "
                                        f"holds 0 (dense) or 1 (MoE) for each layer, e.g. [0, 1, 1, 1]")
            if self.num_experts is not None and len(entries) != self.num_layers:
                raise ScheduleError(f"CostModel.moe_layer_freq has {len(entries)} entries but num_layers="
                                    f"{self.num_layers}; give one 0/1 per layer")
            object.__setattr__(self, "moe_layer_freq", tuple(int(f) for f in entries))
        check_coefficients(*self.coefficients())

    def coefficients(self, formula: str = "exact") -> tuple[float, float]:
        """``(linear, quadratic)`` so that ``fwd_flops(L) = linear * L + quadratic * L**2``; ``"upstream"``: upstream
        slime's ``calculate_fwd_flops`` (dense only, its GQA K/V and output terms)."""
        dense_layer, moe_layer, layer_quadratic, head = self.layer_terms(formula)
        moe = self.moe_layers_in(0, self.num_layers)  # a closed form for an int freq (num_layers may be huge)
        linear = (self.num_layers - moe) * dense_layer + moe * moe_layer + head
        return float(linear), float(self.num_layers * layer_quadratic)

    def layer_terms(self, formula: str = "exact") -> tuple[int, int, int, int]:
        """Forward FLOPs of the pieces, exact integers: ``(dense layer, MoE layer, attention, output layer)``, a layer
        costing ``(dense or MoE) * L + attention * L**2``."""
        h = self.hidden_size
        heads = self.num_attention_heads
        groups = self.num_query_groups or heads
        kv = self.kv_channels or h // heads
        ffn = self.ffn_hidden_size or 4 * h
        mlp_mats = 3 if self.swiglu else 2
        if formula == "exact":
            attn_proj = 2 * h * heads * kv + 2 * h * 2 * groups * kv + 2 * heads * kv * h  # q, k+v, out
        elif formula == "upstream":
            attn_proj = 2 * h * heads * kv + 2 * h * (heads // groups) * kv + 2 * h * h
        else:
            raise ScheduleError(f"formula={formula!r} must be 'exact' or 'upstream'")
        moe_ffn = (self.moe_ffn_hidden_size or ffn) * self.moe_router_topk
        moe_ffn += self.moe_shared_expert_intermediate_size or 0
        # causal QK^T + AV: 2 * (2 * heads * kv * L^2 / 2)
        return (attn_proj + 2 * h * ffn * mlp_mats, attn_proj + 2 * h * moe_ffn * mlp_mats, 2 * heads * kv,
                2 * h * self.vocab_size)

    def moe_layers_in(self, start: int, stop: int) -> int:
        """How many of the layers ``start .. stop - 1`` are MoE (an int ``k``: layers ``0, k, 2k, ...``)."""
        if not self.num_experts or stop <= start:
            return 0
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return sum(1 for f in freq[start:stop] if f)
        k = int(freq)
        return -(-stop // k) - (-(-start // k))

    def flops(self, lengths: Sequence[int] | np.ndarray, formula: str = "exact") -> np.ndarray:
        """Forward FLOPs per sample, vectorised (float64); ``formula`` as in :meth:`coefficients`."""
        linear, quadratic = self.coefficients(formula)
        L = np.asarray(lengths, dtype=np.float64)
        return L * (linear + quadratic * L)

    @classmethod
    def from_args(cls, args: Any) -> "CostModel | None":
        """From Megatron/slime args (any attribute object or mapping); ``None`` when the core dims are absent."""
        kwargs = {k: read_arg(args, k) for k in MODEL_DIMS if read_arg(args, k) is not None}
        if any(k not in kwargs for k in ("hidden_size", "num_layers", "num_attention_heads")):
            return None
        if "vocab_size" not in kwargs and read_arg(args, "padded_vocab_size") is not None:
            kwargs["vocab_size"] = read_arg(args, "padded_vocab_size")
        return cls(**kwargs)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if isinstance(d["moe_layer_freq"], tuple):
            d["moe_layer_freq"] = list(d["moe_layer_freq"])
        return d


#: the model dims, in declaration order (every CostModel field)
MODEL_DIMS = tuple(f.name for f in dataclasses.fields(CostModel))
#: dims without a default: the FLOPs model needs them
REQUIRED_DIMS = tuple(f.name for f in dataclasses.fields(CostModel) if f.default is dataclasses.MISSING)
#: dims that default to ``None`` (Megatron's default): a positive size when given
OPTIONAL_DIMS = tuple(f.name for f in dataclasses.fields(CostModel) if f.default is None)


def check_cost_model(cost_model: Any) -> CostModel | CostProfile | None:
    """``cost_model`` itself, or the :class:`ScheduleError` every entry raises for another type."""
    return check_instance("cost_model", cost_model, (CostModel, CostProfile, type(None)),
                          "a CostModel, a CostProfile or None",
                          "use CostModel(...), CostModel.from_args(args) or CostProfile.load(path)")


def sample_costs(lengths: np.ndarray, cost_model: CostModel | CostProfile | None) -> np.ndarray:
    """Per-sample cost: forward FLOPs, a profile's seconds, or tokens without a model."""
    if cost_model is None:
        return np.asarray(lengths, dtype=np.float64)
    return cost_model.flops(lengths)


def bin_costs(lengths: np.ndarray, costs: np.ndarray, bin_of: np.ndarray, count: int,
              profile: CostProfile | None = None) -> np.ndarray:
    """The one bin pricing: ``(count,)`` the cost of each micro-batch (``bin_of[i]``: sample i's), priced whole with
    a ``profile``, else the sum of its samples' ``costs``."""
    if profile is not None:
        return profile.bin_times(lengths, bin_of, count)
    return np.bincount(bin_of, weights=costs, minlength=count)


def price_sums(tokens: np.ndarray, squares: np.ndarray, sums: np.ndarray, profile: CostProfile | None) -> np.ndarray:
    """:func:`bin_costs` of micro-batches given by their sums of tokens, squared lengths and sample costs."""
    if profile is None:
        return np.array(sums, dtype=np.float64)  # a copy: the caller may keep both
    return profile.price_sums(np.asarray(tokens, dtype=np.float64), np.asarray(squares, dtype=np.float64))


def microbatch_costs(lengths: Sequence[int] | np.ndarray, micro_batches: Sequence[Sequence[int]],
                     cost_model: CostModel | CostProfile | None) -> np.ndarray:
    """``(M,)`` the planner's cost of each micro-batch given as lists of indices into ``lengths``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    members = np.asarray([i for mb in micro_batches for i in mb], dtype=np.int64)
    labels = np.repeat(np.arange(len(micro_batches)), [len(mb) for mb in micro_batches])
    profile = cost_model if isinstance(cost_model, CostProfile) else None
    return bin_costs(lengths[members], sample_costs(lengths[members], cost_model), labels, len(micro_batches),
                     profile)
