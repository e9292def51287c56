"""pytest plugin: run slime's own tests with slime-ext as slime's planner.

    python -m pytest -p slime_planner_plugin SLIME_TREE/tests/test_dp_schedule.py   (tests/hosts on PYTHONPATH)

It switches slime-ext on exactly as the launcher does (``enable()``), then imports ``slime.ray.rollout`` so the
patches land before slime's test module binds ``build_dp_schedule``.
"""

import gpu_stubs

gpu_stubs.install()

from slime_ext.integrations.slime import enable  # noqa: E402

enable()
import slime.ray.rollout  # noqa: E402,F401  (applies the rollout-side patches)
import slime.utils.dp_schedule as _dp  # noqa: E402

assert "slime_ext" in _dp.build_dp_schedule.__code__.co_filename, "slime-ext did not replace the planner"
