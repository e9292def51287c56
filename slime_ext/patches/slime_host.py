"""slime (github.com/THUDM/slime) as a host: where slime-ext's schedule enters slime's own code.

Targets, by slime revision. The revision is read off slime's code, never off a marker it declares
(:func:`detect_revision`):

=============  =====================================================================================
``v0.2.4``     rollout side: ``RolloutManager._split_train_data_by_dp(self, data, dp_size)`` plans with slime-ext;
               ``RolloutManager._get_rollout_data`` leaves trimming to the planner (whole rollouts, reported).
               train side (in each train actor): the actor's bound ``get_data_iterator`` (and ``data``'s) walk
               the sent schedule; ``model.train_one_step`` steps LR and loss normaliser by the step's samples.
``v0.3.0``     ``build_dp_schedule(..., group_indices=...)`` bound in ``slime.ray.rollout`` and defined in
               ``slime.utils.dp_schedule`` -> slime-ext's; the trainer consumes slime's own keys unchanged.
``v0.3.1``     the same with ``rollout_indices=`` (also slime HEAD of 2026-08-21, 624b824).
=============  =====================================================================================

Why the RolloutManager's *class* and *module globals* are patched in the driver: ``RolloutManager`` is a Ray
actor class, which Ray ships to the actor process by value (cloudpickle), together with the globals its methods
use, at the first ``RolloutManager.remote()``. A change made later, or inside the actor process, does not reach
the actor. So the rollout-side patches are applied in the driver when ``slime.ray.rollout`` is imported, before
slime creates the actor (:mod:`slime_ext.integrations.slime` does that). The train actors, by contrast, import
slime's trainer modules themselves; their patches are applied inside them, from slime's
``--custom-megatron-init-path`` hook.

Every patched function checks ``args.dp_schedule`` on each call: with ``legacy`` it runs slime's original.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from . import Patch, PatchError, PatchSet, parameters_are, source_contains

#: the slime revisions this module was checked against (tags, and HEAD by date and commit)
SUPPORTED_TAGS = ("v0.2.4", "v0.3.0", "v0.3.1", "HEAD 2026-08-21 (624b824)")


@dataclass(frozen=True)
class SlimeRevision:
    """What the installed slime looks like, as far as the schedule is concerned."""

    #: ``"0.2.4"`` (split by DP on the rollout side, plan on the train side), ``"0.3.0"`` (rollout-side planner,
    #: ``group_indices=``) or ``"0.3.1"`` (rollout-side planner, ``rollout_indices=``; also later slime)
    version: str
    #: the keyword slime passes the grouping ids under (``None`` at 0.2.4)
    ids_keyword: str | None

    @property
    def plans_on_train_side(self) -> bool:
        return self.version == "0.2.4"


#: keyword Ray's method wrappers take when tracing is on; our replacements accept and drop it
RAY_TRACE_KW = "_ray_trace_ctx"


def rollout_manager_owners(rollout_module: Any) -> list[tuple[str, type]]:
    """``(attribute path in the module, class)`` of the classes behind ``slime.ray.rollout.RolloutManager``: Ray's
    shipped subclass first, then slime's class."""
    obj = rollout_module.RolloutManager
    meta = getattr(obj, "__ray_metadata__", None)
    if meta is None:
        return [("RolloutManager", obj)] if inspect.isclass(obj) else []
    shipped_path = "RolloutManager.__ray_metadata__.modified_class"
    shipped = meta.modified_class
    original = getattr(shipped, "__ray_actor_class__", None)
    owners = [(shipped_path, shipped)]
    if original is not None and original is not shipped:
        owners.append((f"{shipped_path}.__ray_actor_class__", original))
    return owners


def rollout_manager_classes(rollout_module: Any) -> list[type]:
    """The classes behind ``slime.ray.rollout.RolloutManager``: Ray's shipped subclass first, then slime's class."""
    return [cls for _, cls in rollout_manager_owners(rollout_module)]


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def detect_revision() -> SlimeRevision:
    """Read the revision off ``slime.ray.rollout``; ``PatchError`` naming what was expected if nothing matches."""
    try:
        rollout = importlib.import_module("slime.ray.rollout")
    except ImportError as exc:
        raise PatchError(f"cannot import slime.ray.rollout ({exc}); install slime (supported: "
                         f"{', '.join(SUPPORTED_TAGS)})") from exc
    classes = rollout_manager_classes(rollout)
    split = getattr(classes[-1], "_split_train_data_by_dp", None) if classes else None  # slime's own class
    params = [p for p in inspect.signature(split).parameters if p != RAY_TRACE_KW] if split is not None else []
    if params == ["self", "data", "dp_size"] and "get_seqlen_balanced_partitions" in _source(split):
        return SlimeRevision("0.2.4", None)
    if params == ["self", "data"]:
        planner = getattr(rollout, "build_dp_schedule", None)
        keywords = set(inspect.signature(planner).parameters) if planner is not None else set()
        source = _source(split)
        for keyword, version in (("rollout_indices", "0.3.1"), ("group_indices", "0.3.0")):
            if keyword in keywords and f"{keyword}=" in source:
                return SlimeRevision(version, keyword)
    raise PatchError(
        f"slime.ray.rollout is not a slime revision slime-ext knows: expected RolloutManager._split_train_data_by_dp"
        f"(self, data, dp_size) over get_seqlen_balanced_partitions (v0.2.4), or _split_train_data_by_dp(self, data) "
        f"calling build_dp_schedule(..., group_indices=|rollout_indices=) (v0.3.0 and later), found "
        f"_split_train_data_by_dp{tuple(params)}; supported: {', '.join(SUPPORTED_TAGS)}")


def _slime_patch(revision: SlimeRevision, supported: str, tested: tuple[str, ...], **kwargs: Any) -> Patch:
    return Patch(distribution="slime", supported=supported, tested=tested, version=lambda: revision.version,
                 **kwargs)


# ---------------------------------------------------------------------------------------------------- rollout side
def rollout_patches(revision: SlimeRevision, enabled: Callable[[Any], bool], planner: Any) -> PatchSet:
    """Driver-side patches of ``slime.ray.rollout`` (and ``slime.utils.dp_schedule``) for ``revision``.

    ``enabled(args)`` decides per call whether slime-ext plans (``--dp-schedule rollout``) or slime does;
    ``planner`` is what plans (:mod:`slime_ext.integrations.slime.planner`): this module only says where it enters.
    """
    rollout = importlib.import_module("slime.ray.rollout")
    patches: list[Patch] = []
    owners = [path for path, _ in rollout_manager_owners(rollout)]
    if revision.version == "0.2.4":
        for i, owner in enumerate(owners):
            patches.append(_slime_patch(
                revision, "==0.2.4", ("0.2.4",), name=f"slime_split_train_data_by_dp[{i}]", module=rollout.__name__,
                attribute=f"{owner}._split_train_data_by_dp", make=functools.partial(_split_v024, enabled, planner),
                expect=source_contains("get_seqlen_balanced_partitions", "partition"),
                doc="plan the rollout with slime-ext and send each rank its schedule slice"))
            patches.append(_slime_patch(
                revision, "==0.2.4", ("0.2.4",), name=f"slime_get_rollout_data[{i}]", module=rollout.__name__,
                attribute=f"{owner}._get_rollout_data", make=functools.partial(_keep_all_samples, enabled),
                expect=source_contains("disable_rollout_trim_samples", "trim"),
                doc="slime's sample-count trim is left to slime-ext, which trims whole rollouts and reports them"))
        return PatchSet("slime_rollout[0.2.4]", patches)
    for module in (rollout.__name__, "slime.utils.dp_schedule"):
        patches.append(_slime_patch(
            revision, ">=0.3.0", ("0.3.0", "0.3.1"), name=f"slime_build_dp_schedule[{module}]", module=module,
            attribute="build_dp_schedule", make=functools.partial(_build_dp_schedule, enabled, planner),
            expect=_keyword(revision.ids_keyword), doc="slime-ext plans; slime's keys, arity and keyword kept"))
    for i, owner in enumerate(owners):
        patches.append(_slime_patch(
            revision, ">=0.3.0", ("0.3.0", "0.3.1"), name=f"slime_split_metrics[{i}]", module=rollout.__name__,
            attribute=f"{owner}._split_train_data_by_dp", make=functools.partial(_log_metrics_after, enabled, planner),
            expect=source_contains("build_dp_schedule("),
            doc="the plan's figures (dropped samples, ...) go to slime's metrics"))
    return PatchSet(f"slime_rollout[{revision.version}]", patches)


def _keyword(keyword: str | None) -> Callable[[Any], str | None]:
    def check(original: Any) -> str | None:
        params = inspect.signature(original).parameters
        return None if keyword in params else f"it takes no {keyword}= (parameters: {list(params)})"

    return check


def _split_v024(enabled: Callable[[Any], bool], planner: Any, original: Callable) -> Callable:
    def _split_train_data_by_dp(self, data, dp_size, **ray_kwargs):
        ray_kwargs.pop(RAY_TRACE_KW, None)
        if not enabled(self.args):
            return original(self, data, dp_size)
        import ray
        from slime.utils.misc import Box

        payloads = planner.rank_payloads(self.args, data, planner.v024_parallel_config(self.args, dp_size))
        planner.log_plan_metrics(self.args, getattr(self, "rollout_id", 0))
        return [Box(ray.put(p)) for p in payloads]

    return functools.wraps(original)(_split_train_data_by_dp)


def _keep_all_samples(enabled: Callable[[Any], bool], original: Callable) -> Callable:
    def _get_rollout_data(self, *args, **kwargs):
        kwargs.pop(RAY_TRACE_KW, None)
        if not enabled(self.args):
            return original(self, *args, **kwargs)
        saved = self.args.disable_rollout_trim_samples
        self.args.disable_rollout_trim_samples = True  # slime-ext trims whole rollouts in the split, and says so
        try:
            return original(self, *args, **kwargs)
        finally:
            self.args.disable_rollout_trim_samples = saved

    return functools.wraps(original)(_get_rollout_data)


def _build_dp_schedule(enabled: Callable[[Any], bool], planner: Any, original: Callable) -> Callable:
    def planned_by_slime_ext(args, train_parallel_config, total_lengths, **kwargs):
        if not enabled(args):
            return original(args, train_parallel_config, total_lengths, **kwargs)
        return planner.slime_dp_schedule(args, train_parallel_config, total_lengths, **kwargs)

    return functools.wraps(original)(planned_by_slime_ext)  # keeps slime's name, build_dp_schedule


def _log_metrics_after(enabled: Callable[[Any], bool], planner: Any, original: Callable) -> Callable:
    def _split_train_data_by_dp(self, *args, **kwargs):
        kwargs.pop(RAY_TRACE_KW, None)
        refs = original(self, *args, **kwargs)
        if enabled(self.args):
            planner.log_plan_metrics(self.args, getattr(self, "rollout_id", 0))
        return refs

    return functools.wraps(original)(_split_train_data_by_dp)


# ---------------------------------------------------------------------------------------------------- train side
TRAIN_MODULES = ("slime.backends.megatron_utils.actor", "slime.backends.megatron_utils.data",
                 "slime.backends.megatron_utils.model")


def train_revision() -> SlimeRevision:
    """The trainer's revision, read in a train actor: v0.2.4's trainer plans micro-batches itself (an all-reduce
    of the count in ``get_data_iterator(args, model, rollout_data)``); later ones take the schedule as sent."""
    data = importlib.import_module("slime.backends.megatron_utils.data")
    params = list(inspect.signature(data.get_data_iterator).parameters)
    if params == ["args", "model", "rollout_data"]:
        return SlimeRevision("0.2.4", None)
    if params == ["rollout_data"]:
        return SlimeRevision("0.3.1", None)
    raise PatchError(f"slime.backends.megatron_utils.data.get_data_iterator{tuple(params)} is not a trainer "
                     f"slime-ext knows: expected (args, model, rollout_data) (v0.2.4) or (rollout_data) (v0.3.0 and "
                     f"later); supported: {', '.join(SUPPORTED_TAGS)}")


def train_patches(revision: SlimeRevision, enabled: Callable[[Any], bool], trainer: Any) -> PatchSet:
    """In-actor patches for ``revision``: empty after 0.2.4 (slime's trainer consumes the schedule itself).

    ``trainer`` is what walks the sent schedule (:mod:`slime_ext.integrations.slime.trainer`)."""
    if not revision.plans_on_train_side:
        return PatchSet(f"slime_train[{revision.version}]", [])
    data = importlib.import_module("slime.backends.megatron_utils.data")
    patches = [
        _slime_patch(revision, "==0.2.4", ("0.2.4",), name=f"slime_get_data_iterator[{module}]", module=module,
                     attribute="get_data_iterator", make=functools.partial(_get_data_iterator, enabled, trainer, data),
                     expect=source_contains("all_reduce", "num_microbatches"),
                     doc="iterators and num_microbatches from the rollout-side schedule; no planning, no all-reduce")
        for module in ("slime.backends.megatron_utils.actor", "slime.backends.megatron_utils.data")
    ]
    patches.append(_slime_patch(
        revision, "==0.2.4", ("0.2.4",), name="slime_train_one_step", module="slime.backends.megatron_utils.model",
        attribute="train_one_step", make=trainer.wrap_train_one_step,
        expect=source_contains("opt_param_scheduler.step(increment=args.global_batch_size)", "loss_function"),
        doc="LR increment and loss normaliser follow the step's real sample count"))
    return PatchSet("slime_train[0.2.4]", patches)


#: the parameters of slime's ``MegatronTrainRayActor.compute_log_prob`` the replacement takes, at every tag
LOG_PROB_PARAMETERS = ("self", "data_iterator", "num_microbatches", "store_prefix")


def _expect_log_prob_pass(original: Any) -> str | None:
    missing = parameters_are(LOG_PROB_PARAMETERS)(original) or source_contains("forward_only(", "num_microbatches")(
        original)
    if missing:
        return missing
    # slime's forward_only puts each result back in the rank's sample order by the iterators' micro-batch indices
    model = importlib.import_module("slime.backends.megatron_utils.model")
    reorder = source_contains("data_iterator[0].micro_batch_indices")(model.forward_only)
    return f"slime.backends.megatron_utils.model.forward_only: {reorder}" if reorder else None


def log_prob_patches(revision: SlimeRevision, wrap: Callable[[Callable], Callable]) -> PatchSet:
    """In-actor patch of the log-prob passes (``--log-probs-max-tokens-per-gpu`` set apart from
    ``--max-tokens-per-gpu``): ``MegatronTrainRayActor.compute_log_prob`` runs on the iterators and counts ``wrap``
    gives it (:func:`slime_ext.integrations.slime.log_probs.wrap_compute_log_prob`); same shape at every tag."""
    return PatchSet(f"slime_log_probs[{revision.version}]", [_slime_patch(
        revision, ">=0.2.4", ("0.2.4", "0.3.0", "0.3.1"), name="slime_compute_log_prob",
        module="slime.backends.megatron_utils.actor", attribute="MegatronTrainRayActor.compute_log_prob", make=wrap,
        expect=_expect_log_prob_pass,
        doc="the log-prob passes walk their own forward-only plan under --log-probs-max-tokens-per-gpu")])


def _get_data_iterator(enabled: Callable[[Any], bool], trainer: Any, data_module: Any, original: Callable) -> Callable:
    def get_data_iterator(args, model, rollout_data):
        if not enabled(args):
            return original(args, model, rollout_data)
        from megatron.core import mpu

        vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
        return trainer.get_data_iterator(args, model, rollout_data, data_iterator_cls=data_module.DataIterator,
                                         vpp_size=vpp)

    return functools.wraps(original)(get_data_iterator)


# ---------------------------------------------------------------------------------------------------- arguments
def args_patches(add_arguments: Callable[[Any], Any], finish: Callable[[Any], None]) -> PatchSet:
    """slime's argument parsing: ``add_arguments(parser)`` joins slime-ext's options to slime's parser *after*
    slime's own (slime adds a user's ``add_custom_arguments`` before its own, so an option slime also has would
    clash), so they are really parsed, with ``--help``; ``finish(args)`` runs on the parsed result."""

    def make_provider(original: Callable) -> Callable:
        def get_slime_extra_args_provider(*args, **kwargs):
            add_slime_arguments = original(*args, **kwargs)

            def add_slime_and_slime_ext_arguments(parser):
                return add_arguments(add_slime_arguments(parser) or parser)

            return add_slime_and_slime_ext_arguments

        return functools.wraps(original)(get_slime_extra_args_provider)

    def make_parse(original: Callable) -> Callable:
        def parse_args(*args, **kwargs):
            parsed = original(*args, **kwargs)
            finish(parsed)
            return parsed

        return functools.wraps(original)(parse_args)

    # both have had these shapes at every supported tag: the source checks are the gate
    common = dict(module="slime.utils.arguments", distribution="slime", supported=">=0",
                  tested=("0.2.4", "0.3.0", "0.3.1"), version=lambda: "0")
    return PatchSet("slime_args", [
        Patch(name="slime_args_provider", attribute="get_slime_extra_args_provider", make=make_provider,
              expect=source_contains("add_custom_arguments", "def add_slime_arguments"),
              doc="slime-ext's options in slime's own parser, after slime's", **common),
        Patch(name="slime_parse_args", attribute="parse_args", make=make_parse,
              expect=source_contains("get_slime_extra_args_provider("),
              doc="slime-ext's settings follow the parsed flags",
              **common),
    ])
