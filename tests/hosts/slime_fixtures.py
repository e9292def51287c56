"""What slime's RolloutManager loads by dotted path in the actor test: a data source and a rollout function.

The rollout is fixed (no model serves it): ``ROLLOUTS[k]`` are the sample lengths of rollout ``k``, and sample
``i`` (in slime's flattened order) has tokens ``[i] * length``, so the trainer side can tell samples apart.
"""

from __future__ import annotations

#: compact-style rollouts of 1..3 samples; with 2 rollouts per step the last one (3 samples) is trimmed whole
ROLLOUTS = [[40, 22], [80], [12, 13], [200], [70, 70], [44], [150, 3], [66], [10, 10, 25]]


class TinyDataSource:
    def __init__(self, args):
        self.args = args

    def save(self, rollout_id):
        pass

    def load(self, rollout_id=None):
        pass

    def __len__(self):
        return len(ROLLOUTS)


def generate(args, rollout_id, data_source, evaluation=False):
    from slime.utils.types import Sample

    groups, position = [], 0
    for rid, lengths in enumerate(ROLLOUTS):
        group = []
        for length in lengths:
            sample = Sample(index=rid, tokens=[position] * length, response_length=max(1, length // 2),
                            reward=float(position % 3))
            for field in ("rollout_id", "group_id"):  # the grouping id, named as this slime names it
                if hasattr(sample, field):
                    setattr(sample, field, rid)
            sample.loss_mask = [1] * sample.response_length
            sample.status = Sample.Status.COMPLETED
            group.append(sample)
            position += 1
        groups.append(group)
    return groups


def close_tensorboard(manager) -> None:
    """Run inside the RolloutManager actor: close slime's tensorboard writer so its events reach the disk."""
    try:
        from slime.observability.tensorboard_utils import _TensorboardAdapter
    except ImportError:
        from slime.utils.tensorboard_utils import _TensorboardAdapter
    _TensorboardAdapter(manager.args).finish()


def read_tensorboard(directory: str) -> dict[str, list[float]]:
    """Every scalar slime logged to tensorboard under ``directory``: ``{tag: [values]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory)
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


_captured: list[str] = []


def capture_log(manager) -> int:
    """Run inside the RolloutManager actor: keep what slime-ext logs there (Ray streams actor logs to the driver
    asynchronously, so the test asks the actor instead). Returns the actor's pid."""
    import logging
    import os

    class Keep(logging.Handler):
        def emit(self, record):
            _captured.append(record.getMessage())

    log = logging.getLogger("slime_ext.integrations.slime")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    return os.getpid()


def captured_log(manager) -> dict:
    """Run inside the RolloutManager actor: its pid, what slime-ext logged there, and the plan it made there."""
    import os

    from slime_ext.integrations.slime import planner

    report = planner.last_report
    return {"pid": os.getpid(), "log": list(_captured), "report": None if report is None else report.metrics()}
