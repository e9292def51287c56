"""Per-stage costs: per virtual stage ``k = chunk * pp + rank``, ``forward = linear[k] * tokens + quadratic[k] *
sum(L**2)`` in the cost model's units, the layers split as megatron-core splits them (:mod:`.pipeline_layout`).

A ``CostModel`` counts each decoder layer's FLOPs (dense or MoE), the output layer's ``2 h vocab`` per token on the
last stage, and an MTP layer as a decoder layer plus its ``2 (2h) h`` input projection and its own output layer; the
embedding and the loss count as none. A profile's seconds are split by its measured piece shares
(``meta["piece_shares"]``), else by the FLOPs of its recorded dims (``meta["model"]``), else by decoder layers, as
tokens are; with no layer count, evenly. Overheads are not split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import LAYOUT_FLAGS, ParallelConfig
from .cost import CostModel, MODEL_DIMS, REQUIRED_DIMS, check_cost_model
from .errors import ScheduleError
from .pipeline_layout import StageLayers, parse_layout
from .profile import CostProfile
from .validate import check_instance

__all__ = ["StageCosts"]


@dataclass(frozen=True)
class StageCosts:
    """Forward cost coefficients per virtual stage ``k = chunk * pp + rank`` (see the module docstring)."""

    pp_size: int
    vpp_size: int
    #: per virtual stage: cost per token, and per squared sample length (attention)
    virtual_linear: tuple[float, ...]
    virtual_quadratic: tuple[float, ...]
    #: how the split was derived, in one line (for reports)
    basis: str = ""

    def __post_init__(self) -> None:
        v = self.pp_size * self.vpp_size
        for name in ("virtual_linear", "virtual_quadratic"):
            values = tuple(float(x) for x in getattr(self, name))
            if len(values) != v or not all(np.isfinite(values)) or min(values) < 0:
                raise ScheduleError(f"StageCosts.{name} = {values} must hold pp_size * vpp_size = {v} finite "
                                    f"costs >= 0, one per virtual stage")
            object.__setattr__(self, name, values)

    def _per_rank(self, values: tuple[float, ...]) -> np.ndarray:
        return np.asarray(values).reshape(self.vpp_size, self.pp_size).sum(axis=0)

    @property
    def linear(self) -> np.ndarray:
        """``(pp,)``: cost per token of each pipeline rank (all its chunks)."""
        return self._per_rank(self.virtual_linear)

    @property
    def quadratic(self) -> np.ndarray:
        """``(pp,)``: cost per squared sample length of each pipeline rank."""
        return self._per_rank(self.virtual_quadratic)

    @property
    def linear_share(self) -> np.ndarray:
        """``(pp,)``: each rank's share of the linear term (sums to 1)."""
        return _share(self.linear)

    @property
    def quadratic_share(self) -> np.ndarray:
        """``(pp,)``: each rank's share of the quadratic term (sums to 1; even where the model has none)."""
        return _share(self.quadratic)

    @property
    def uneven(self) -> bool:
        """Whether the ranks' costs differ."""
        return bool(np.ptp(self.linear) > 0 or np.ptp(self.quadratic) > 0)

    @classmethod
    def from_model(cls, cost_model: CostModel | CostProfile | None, parallel: ParallelConfig) -> "StageCosts":
        """The split of ``cost_model``'s cost over ``parallel``'s pipeline (the module docstring)."""
        check_instance("parallel", parallel, ParallelConfig, "a ParallelConfig")
        if check_cost_model(cost_model) is None:
            share, basis = _layer_share(parallel)
            return cls(parallel.pp_size, parallel.vpp_size, tuple(share), (0.0,) * len(share), basis)
        if isinstance(cost_model, CostModel):
            return _from_dims(cost_model, parallel)
        linear, quadratic = cost_model.coefficients()  # a profile's seconds
        dims = _profile_dims(cost_model)
        measured = _measured_shares(cost_model, parallel, dims.num_layers if dims is not None else None)
        if measured is not None:
            lin_share, quad_share = measured
            basis = "profile seconds split by its measured piece shares (embedding, layers, output layer)"
        elif dims is not None:
            flops = _from_dims(dims, parallel)
            lin_share = _share(np.asarray(flops.virtual_linear))
            quad_share = _share(np.asarray(flops.virtual_quadratic))
            basis = "profile seconds split by the FLOPs shares of its model dims"
        else:
            lin_share, basis = _layer_share(parallel)
            quad_share = lin_share
            basis = f"profile seconds split by {basis}"
        return cls(parallel.pp_size, parallel.vpp_size, tuple(linear * np.asarray(lin_share)),
                   tuple(quadratic * np.asarray(quad_share)), basis)

    @classmethod
    def if_split(cls, cost_model: CostModel | CostProfile | None, parallel: ParallelConfig) -> "StageCosts | None":
        """:meth:`from_model`, or ``None`` (every stage alike) for dims Megatron cannot split evenly; where the user
        placed layers the refusal stands."""
        try:
            return cls.from_model(cost_model, parallel)
        except ScheduleError:
            if any(getattr(parallel, flag) not in (None, False) for flag in LAYOUT_FLAGS):
                raise
            return None


def _share(values: np.ndarray) -> np.ndarray:
    total = values.sum()
    return values / total if total > 0 else np.full(len(values), 1.0 / len(values))


def _from_dims(model: CostModel, parallel: ParallelConfig) -> StageCosts:
    layers = parallel.stage_layers(model.num_layers)
    dense_layer, moe_layer, layer_quadratic, head = model.layer_terms()
    mtp_layer = (moe_layer if model.num_experts else dense_layer) + 2 * (2 * model.hidden_size) * model.hidden_size
    linear, quadratic = [], []
    for k, (first, count, mtp) in enumerate(zip(layers.first_layer, layers.decoder, layers.mtp)):
        moe = model.moe_layers_in(first, first + count)
        lin = (count - moe) * dense_layer + moe * moe_layer + mtp * (mtp_layer + head)  # exact integers
        if k == len(layers.decoder) - 1:
            lin += head
        linear.append(float(lin))
        quadratic.append(float((count + mtp) * layer_quadratic))
    return StageCosts(parallel.pp_size, parallel.vpp_size, tuple(linear), tuple(quadratic),
                      "FLOPs of the model dims per stage")


def _profile_dims(profile: CostProfile) -> CostModel | None:
    """The model dims a profile records (``meta["model"]``), or ``None`` where they are missing or invalid."""
    dims = (profile.meta or {}).get("model")
    if not isinstance(dims, dict) or any(dims.get(k) is None for k in REQUIRED_DIMS):
        return None
    try:
        return CostModel(**{k: v for k, v in dims.items() if k in MODEL_DIMS and v is not None})
    except (ScheduleError, TypeError):
        return None


def _measured_shares(profile: CostProfile, parallel: ParallelConfig, num_layers: int | None):
    """Per virtual stage ``(linear share, quadratic share)`` from ``meta["piece_shares"]`` (attention split by
    decoder layers), or ``None`` without them or a layer count."""
    pieces = (profile.meta or {}).get("piece_shares")
    if not isinstance(pieces, dict):
        return None
    try:
        emb, layer, head = (float(pieces[k]) for k in ("embedding", "layer", "head"))
    except (KeyError, TypeError, ValueError):
        return None
    if not all(np.isfinite([emb, layer, head])) or min(emb, layer, head) < 0:
        return None
    num_layers = _layer_count(parallel, num_layers)
    if num_layers is None:
        return None
    layers = parallel.stage_layers(num_layers)
    decoder, mtp = np.asarray(layers.decoder, dtype=np.float64), np.asarray(layers.mtp, dtype=np.float64)
    linear = layer * (decoder + mtp) + head * mtp
    linear[0] += emb
    linear[-1] += head
    return _share(linear), _share(decoder + mtp)


def _layer_share(parallel: ParallelConfig) -> tuple[np.ndarray, str]:
    """Each virtual stage's share of the decoder layers (of a layout string), and how it was found."""
    v = parallel.pp_size * parallel.vpp_size
    num_layers = _layer_count(parallel, None)
    if num_layers is None:
        return np.full(v, 1.0 / v), "an even split (the layer count is unknown)"
    layers: StageLayers = parallel.stage_layers(num_layers)
    counts = np.asarray(layers.decoder, dtype=np.float64)
    return _share(counts), "each stage's share of the decoder layers"


def _layer_count(parallel: ParallelConfig, num_layers: int | None) -> int | None:
    """``num_layers``, else the decoder layers of the layout string, else ``None``."""
    layout = parallel.pipeline_model_parallel_layout
    if num_layers is None and layout is not None:
        return sum(stage.count("t") for stage in parse_layout(layout))
    return num_layers
