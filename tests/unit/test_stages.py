"""Per-stage costs (slime_ext.schedule.stages) and Megatron's layout flags (slime_ext.schedule.pipeline_layout):
the split against megatron-core's own, its refusals, and the cost invariants of the stages module's docstring."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

from slime_ext.schedule import CostModel, CostProfile, ParallelConfig, ScheduleError
from slime_ext.schedule.pipeline_model import PipelineSpec, pipeline_makespan
from slime_ext.schedule.pipeline_layout import parse_layout, split_layers
from slime_ext.schedule.stages import StageCosts

QWEN3_8B = dict(hidden_size=4096, num_layers=36, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=12288,
                vocab_size=151936, swiglu=True)
MOE = dict(hidden_size=2048, num_layers=12, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=6144,
           vocab_size=32000, num_experts=8, moe_ffn_hidden_size=1024, moe_router_topk=2,
           moe_layer_freq=(0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), swiglu=True)


# ---------------------------------------------------------------------------------------------------- the layout
LAYOUTS = ["Ett|(tt|)*2,tL", "E|t*3|t|*2tL", "Et*3|(tt|)*6,ttL", "E,t|t,t|t|tL", "(Et|)*1tt|ttL", "Ettt|ttmL",
           "E|(t|)*3,m|L", "Etttt|tL", "Et*0|ttL"]


def test_layout_strings_parse_as_megatron_core_parses_them():
    layout_mod = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    letters = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    for text in LAYOUTS:
        theirs = layout_mod.PipelineParallelLayerLayout.parse_str_to_list(text)
        assert parse_layout(text) == tuple(tuple(letters[x.name] for x in stage) for stage in theirs), text


@pytest.mark.parametrize("text, match", [
    ("Ett|tx", "'x' at 5 is not a layer letter"), ("E(tt|tL", "never closed"), ("E(tt|)tL", "needs a count"),
    ("E((t)*2)*2|L", "no other group"), ("", "non-empty string"), ("E**2|L", "repeats nothing"),
])
def test_bad_layout_strings_are_refused(text, match):
    with pytest.raises(ScheduleError, match=match):
        parse_layout(text)


def megatron_split(num_layers, pp, vpp, **flags):
    """megatron-core's decoder layers per virtual stage (chunk * pp + rank), or None where it refuses."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {"decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
             "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage"}
    kwargs = {names.get(k, k): v for k, v in flags.items()}
    mtp = sum(stage.count("m") for stage in parse_layout(flags["pipeline_model_parallel_layout"])) \
        if flags.get("pipeline_model_parallel_layout") else 0
    if mtp:  # megatron-core checks the layout's MTP layers against the model's (ours has no MTP count)
        kwargs["mtp_num_layers"] = mtp
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                                    pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                    virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, **kwargs)
        if cfg.pipeline_model_parallel_layout is not None:
            layout = cfg.pipeline_model_parallel_layout.layout
            out = [layout[s][c].count(LayerType.decoder) for c in range(vpp) for s in range(pp)]
        else:
            out = [get_num_layers_to_build(cfg, vp_stage=c if vpp > 1 else None, pp_rank=s)
                   for c in range(vpp) for s in range(pp)]
    except (AssertionError, ValueError):
        return None
    return None if min(out) < 0 else tuple(out)


def ours(num_layers, pp, vpp, **flags):
    try:
        return split_layers(num_layers, pp_size=pp, vpp_size=vpp, **flags).decoder
    except ScheduleError:
        return None


def test_the_split_and_its_refusals_are_megatron_cores():
    """Every combination of the flags on small models: the same layers per virtual stage where megatron-core
    builds the model, a ScheduleError where it refuses (a config error, a failed assertion or a negative count)."""
    cases = refused = 0
    for n, pp, vpp in itertools.product((7, 8, 12, 36), (2, 4), (1, 2)):
        for first, last, emb, loss in itertools.product((None, 2, 3), (None, 2, 3), (False, True), (False, True)):
            flags = dict(decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                         account_for_embedding_in_pipeline_split=emb, account_for_loss_in_pipeline_split=loss)
            theirs = megatron_split(n, pp, vpp, **flags)
            assert ours(n, pp, vpp, **flags) == theirs, (n, pp, vpp, flags)
            cases += 1
            refused += theirs is None
    for text, n, pp in (("Ett|(tt|)*2,tL", 7, 2), ("Ett|(tt|)*2,tL", 7, 4), ("Ett|(tt|)*2,tL", 8, 4),
                        ("E|t*3|t|*2tL", 6, 5), ("Et*3|(tt|)*6,ttL", 17, 4), ("Ettt|ttmL", 5, 2),
                        ("Etttt|tL", 5, 2), ("Ettt|tL|t|t", 6, 2)):
        vpp = len(parse_layout(text)) // pp if len(parse_layout(text)) % pp == 0 else 1
        theirs = megatron_split(n, pp, vpp, pipeline_model_parallel_layout=text)
        assert ours(n, pp, vpp, pipeline_model_parallel_layout=text) == theirs, (text, n, pp)
        cases += 1
        refused += theirs is None
    assert 0 < refused < cases  # both kinds of case are covered
    # (a layout of several stages at pp 1 passes megatron-core's TransformerConfig but not Megatron-LM's argument
    # checks, which refuse the interleaved schedule without pipelining: refused here, see the next tests)


def test_refusals_name_the_flags_and_the_fix():
    with pytest.raises(ScheduleError, match="38 layers .* do not split evenly over pp_size 4"):
        split_layers(36, pp_size=4, account_for_embedding_in_pipeline_split=True,
                     account_for_loss_in_pipeline_split=True)
    with pytest.raises(ScheduleError, match="cannot be combined with account_for"):
        split_layers(36, pp_size=4, decoder_first_pipeline_num_layers=6, account_for_loss_in_pipeline_split=True)
    with pytest.raises(ScheduleError, match="leave 25 layers for 2 middle ranks x 1 chunks"):
        split_layers(36, pp_size=4, decoder_first_pipeline_num_layers=6, decoder_last_pipeline_num_layers=5)
    with pytest.raises(ScheduleError, match="leave -4 layers"):
        split_layers(8, pp_size=4, decoder_first_pipeline_num_layers=6, decoder_last_pipeline_num_layers=6)
    with pytest.raises(ScheduleError, match="multiple of vpp_size = 2"):
        split_layers(36, pp_size=4, vpp_size=2, decoder_first_pipeline_num_layers=3)
    with pytest.raises(ScheduleError, match="holds 6 decoder layers 't' but num_layers = 7"):
        split_layers(7, pp_size=2, vpp_size=2, pipeline_model_parallel_layout="Ett|(tt|)*2,L")
    with pytest.raises(ScheduleError, match="must end with the loss 'L'"):
        split_layers(7, pp_size=2, vpp_size=2, pipeline_model_parallel_layout="Ett|(tt|)*2,tLt")
    with pytest.raises(ScheduleError, match="needs pipeline parallelism"):
        split_layers(8, pp_size=1, decoder_first_pipeline_num_layers=8)


# ---------------------------------------------------------------------------------------------------- ParallelConfig
def test_parallel_config_holds_the_layout_flags():
    cfg = ParallelConfig(dp_size=2, pp_size=4, decoder_first_pipeline_num_layers=6,
                         decoder_last_pipeline_num_layers=6)
    assert cfg.stage_layers(36).decoder == (6, 12, 12, 6)
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    # Megatron-LM derives the virtual pipeline size from a layout string
    laid = ParallelConfig.from_megatron(4, pipeline_model_parallel_size=4,
                                        pipeline_model_parallel_layout="Et|(tt|)*6,tL")
    assert (laid.vpp_size, laid.microbatch_group_size_per_vp_stage, laid.overlap_p2p_comm) == (2, 4, True)
    assert laid.stage_layers(14).decoder == (1, 2, 2, 2, 2, 2, 2, 1)
    with pytest.raises(ScheduleError, match="has 2 stages but pp_size = 1"):
        ParallelConfig.from_megatron(4, pipeline_model_parallel_layout="Et|tL")  # no pipeline size given
    assert ParallelConfig.from_megatron(4, pipeline_model_parallel_layout="EttL").vpp_size == 1
    # without pipelining the account flags change nothing: configs that plan alike compare equal
    assert ParallelConfig(dp_size=2, account_for_loss_in_pipeline_split=True) == ParallelConfig(dp_size=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp_size=4, decoder_first_pipeline_num_layers=0), "decoder_first_pipeline_num_layers"),
    (dict(pp_size=4, decoder_last_pipeline_num_layers="6"), "decoder_last_pipeline_num_layers"),
    (dict(pp_size=4, account_for_loss_in_pipeline_split="yes"), "account_for_loss_in_pipeline_split"),
    (dict(pp_size=4, pipeline_model_parallel_layout=3), "pipeline_model_parallel_layout = 3 must be a string"),
    (dict(pp_size=4, pipeline_model_parallel_layout="Et|(tt|)*6,tL"), "pass vpp_size = 2"),
    (dict(pp_size=4, pipeline_model_parallel_layout="Et|tt|tL"), "3 stages, not a multiple of pp_size = 4"),
    (dict(pp_size=4, vpp_size=2, pipeline_model_parallel_layout="Et|(tt|)*6,tL",
          account_for_embedding_in_pipeline_split=True), "cannot be combined"),
    (dict(pp_size=4, decoder_first_pipeline_num_layers=2, account_for_embedding_in_pipeline_split=True),
     "cannot be combined"),
    (dict(pp_size=1, decoder_last_pipeline_num_layers=2), "needs pipeline parallelism"),
    (dict(pp_size=1, vpp_size=2, pipeline_model_parallel_layout="Et|tL"), "has 2 stages but pp_size = 1"),
])
def test_parallel_config_refuses_bad_layout_flags(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        ParallelConfig(dp_size=2, **kwargs)


# ---------------------------------------------------------------------------------------------------- the costs
def check_invariants(costs: StageCosts, total_linear: float, total_quadratic: float) -> None:
    """The stages module's invariants: the stages sum to the whole model, the shares to 1."""
    assert costs.linear.sum() == pytest.approx(total_linear, rel=1e-12)
    assert costs.quadratic.sum() == pytest.approx(total_quadratic, rel=1e-12)
    assert costs.linear_share.sum() == pytest.approx(1.0) and costs.quadratic_share.sum() == pytest.approx(1.0)
    assert costs.linear.shape == (costs.pp_size,) and len(costs.virtual_linear) == costs.pp_size * costs.vpp_size


PARALLELS = [
    ParallelConfig(dp_size=1, pp_size=4),
    ParallelConfig(dp_size=1, pp_size=4, decoder_first_pipeline_num_layers=6, decoder_last_pipeline_num_layers=6),
    ParallelConfig(dp_size=1, pp_size=4, vpp_size=3, decoder_first_pipeline_num_layers=6),
    ParallelConfig(dp_size=1, pp_size=2, account_for_embedding_in_pipeline_split=True,
                   account_for_loss_in_pipeline_split=True),
    ParallelConfig.from_megatron(1, pipeline_model_parallel_size=4,
                                 pipeline_model_parallel_layout="Et*4|(t*5|)*6,t*2L"),
    ParallelConfig(dp_size=1),
]


@pytest.mark.parametrize("parallel", PARALLELS, ids=lambda p: f"pp{p.pp_size}")
def test_stage_flops_add_up_to_the_model(parallel):
    for dims in (QWEN3_8B, MOE):
        model = CostModel(**dims)
        try:
            parallel.stage_layers(model.num_layers)
        except ScheduleError:
            continue  # a split Megatron refuses for this model (checked above)
        costs = StageCosts.from_model(model, parallel)
        check_invariants(costs, *model.coefficients())
        assert costs.basis == "FLOPs of the model dims per stage"


def test_the_output_layer_weighs_on_the_last_stage():
    model = CostModel(**QWEN3_8B)
    dense, _, attention, head = model.layer_terms()
    costs = StageCosts.from_model(model, ParallelConfig(dp_size=1, pp_size=4))
    np.testing.assert_array_equal(costs.linear, [9 * dense] * 3 + [9 * dense + head])
    np.testing.assert_array_equal(costs.quadratic, [9 * attention] * 4)
    assert costs.uneven and 1.3 < costs.linear[-1] / costs.linear[0] < 1.4  # the "a third of a stage"
    # accounting for the embedding and the loss moves a layer off each end
    moved = StageCosts.from_model(CostModel(**{**QWEN3_8B, "num_layers": 34}), ParallelConfig(
        dp_size=1, pp_size=4, account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True))
    np.testing.assert_array_equal(moved.linear, [8 * dense, 9 * dense, 9 * dense, 8 * dense + head])
    # under VPP the output layer sits on the last rank's last chunk
    vpp = StageCosts.from_model(model, ParallelConfig(dp_size=1, pp_size=2, vpp_size=2))
    np.testing.assert_array_equal(vpp.virtual_linear, [9 * dense] * 3 + [9 * dense + head])


def test_moe_layers_are_placed_by_their_layer_numbers():
    model = CostModel(**MOE)  # layers 0 and 1 dense, 2.. MoE
    dense, moe, _, head = model.layer_terms()
    costs = StageCosts.from_model(model, ParallelConfig(dp_size=1, pp_size=3))
    np.testing.assert_array_equal(costs.linear, [2 * dense + 2 * moe, 4 * moe, 4 * moe + head])


def test_mtp_layers_of_a_layout_cost_a_layer_and_an_output_layer():
    model = CostModel(**{**QWEN3_8B, "num_layers": 5})
    dense, _, attention, head = model.layer_terms()
    h = QWEN3_8B["hidden_size"]
    costs = StageCosts.from_model(model, ParallelConfig.from_megatron(
        1, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettt|ttmL"))
    np.testing.assert_array_equal(costs.linear, [3 * dense, 2 * dense + (dense + 4 * h * h + head) + head])
    np.testing.assert_array_equal(costs.quadratic, [3 * attention, 3 * attention])


def test_a_profile_splits_by_its_model_dims_or_by_layers():
    model = CostModel(**QWEN3_8B)
    parallel = ParallelConfig(dp_size=1, pp_size=4, decoder_first_pipeline_num_layers=6,
                              decoder_last_pipeline_num_layers=6)
    profile = CostProfile(step_overhead_s=0.1, microbatch_overhead_s=0.01, per_token_s=2e-6,
                          per_sample_quadratic_s=1e-10, packed_quadratic_s=1e-11,
                          meta={"model": model.to_dict()})
    costs = StageCosts.from_model(profile, parallel)
    check_invariants(costs, 2e-6, 1.1e-10)
    flops = StageCosts.from_model(model, parallel)
    np.testing.assert_allclose(costs.linear_share, flops.linear_share, rtol=1e-12)
    np.testing.assert_allclose(costs.quadratic_share, [6 / 36, 12 / 36, 12 / 36, 6 / 36], rtol=1e-12)
    assert costs.basis == "profile seconds split by the FLOPs shares of its model dims"
    # calibrate's older profiles record only some dims: still a CostModel; none at all: layers' share
    bare = CostProfile(step_overhead_s=0.0, microbatch_overhead_s=0.0, per_token_s=1.0, per_sample_quadratic_s=0.0)
    by_layers = StageCosts.from_model(bare, ParallelConfig(dp_size=1, pp_size=4,
                                                           pipeline_model_parallel_layout="Et*6|t*12|t*12|t*6L"))
    np.testing.assert_allclose(by_layers.linear, [6 / 36, 12 / 36, 12 / 36, 6 / 36])
    assert "decoder layers" in by_layers.basis
    even = StageCosts.from_model(bare, ParallelConfig(dp_size=1, pp_size=4))
    np.testing.assert_allclose(even.linear, [0.25] * 4)
    assert "even split" in even.basis


def test_without_a_model_the_split_is_by_layers_in_tokens():
    laid = ParallelConfig.from_megatron(1, pipeline_model_parallel_size=4,
                                        pipeline_model_parallel_layout="Et*4|(t*5|)*6,t*2L")
    costs = StageCosts.from_model(None, laid)  # the layout string knows the layers: 4, 5 + 5, ..., 5 + 2
    np.testing.assert_allclose(costs.linear, np.array([4 + 5, 10, 10, 5 + 2]) / 36)
    check_invariants(costs, 1.0, 0.0)
    assert costs.basis == "each stage's share of the decoder layers"


def test_stage_coefficients_feed_the_pipeline_model():
    model = CostModel(**QWEN3_8B)
    costs = StageCosts.from_model(model, ParallelConfig(dp_size=1, pp_size=4, vpp_size=3))
    rng = np.random.default_rng(0)
    lengths = [rng.integers(100, 4000, size=rng.integers(1, 5)) for _ in range(8)]
    tokens = np.array([L.sum() for L in lengths], dtype=float)
    squares = np.array([(L.astype(float) ** 2).sum() for L in lengths])
    f = costs.linear[:, None] * tokens + costs.quadratic[:, None] * squares  # (pp, M): per rank
    np.testing.assert_allclose(f.sum(axis=0), [model.flops(L).sum() for L in lengths], rtol=1e-12)
    fv = (np.asarray(costs.virtual_linear)[:, None] * tokens + np.asarray(costs.virtual_quadratic)[:, None] * squares
          )[None]  # (1, pp * vpp, M): one model chunk each
    np.testing.assert_allclose(fv[0].reshape(3, 4, 8).sum(axis=0), f, rtol=1e-12)  # a rank's chunks add up
    spec = PipelineSpec(4, 3)
    # per virtual stage puts the output layer on the last chunk; per rank spreads it over the last rank's chunks
    exact, spread = pipeline_makespan(fv, 2 * fv, spec)[0], pipeline_makespan(f[None], 2 * f[None], spec)[0]
    assert exact > spread  # here the heavy last chunk lengthens the critical path by several percent
    with pytest.raises(ScheduleError, match="cost_model must be"):
        StageCosts.from_model("dims", ParallelConfig(dp_size=1, pp_size=4))


def test_a_profile_with_measured_piece_shares_splits_by_them():
    parallel = ParallelConfig(dp_size=1, pp_size=4, decoder_first_pipeline_num_layers=1,
                              decoder_last_pipeline_num_layers=1)
    # what calibrate records: the embedding 2%, each of 8 layers 10%, the final norm and output layer 18%
    meta = {"model": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 1000},
            "piece_shares": {"embedding": 0.02, "layer": 0.10, "head": 0.18, "how": "forward hooks"}}
    profile = CostProfile(step_overhead_s=0.0, microbatch_overhead_s=0.0, per_token_s=1e-5,
                          per_sample_quadratic_s=1e-9, meta=meta)
    costs = StageCosts.from_model(profile, parallel)
    np.testing.assert_allclose(costs.linear_share, [0.02 + 0.10, 0.30, 0.30, 0.10 + 0.18], rtol=1e-12)
    np.testing.assert_allclose(costs.quadratic_share, [1 / 8, 3 / 8, 3 / 8, 1 / 8], rtol=1e-12)
    check_invariants(costs, 1e-5, 1e-9)
    assert "measured piece shares" in costs.basis
    # unreadable piece shares fall back to the FLOPs shares of the model dims
    broken = CostProfile(step_overhead_s=0.0, microbatch_overhead_s=0.0, per_token_s=1e-5,
                         per_sample_quadratic_s=1e-9, meta={**meta, "piece_shares": {"embedding": "x"}})
    assert "FLOPs shares" in StageCosts.from_model(broken, parallel).basis
