"""The one exception the planning layer raises for bad input or impossible configs."""


class ScheduleError(ValueError):
    """Bad input or a config the scheduler cannot satisfy.

    The message always names the field, the offending value and how to fix it, e.g.
    ``ScheduleError: step 3 has 5 samples but dp_size*mb_group = 8; lower --global-batch-size or raise the rollout size``.
    """
