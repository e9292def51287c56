"""The one exception the planning layer raises for bad input or impossible configs."""


class ScheduleError(ValueError):
    """Bad input or a config the scheduler cannot satisfy; the message names the field, the value and the fix."""
