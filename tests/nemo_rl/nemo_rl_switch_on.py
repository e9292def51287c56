"""A pytest plugin (``-p nemo_rl_switch_on``) that enables slime-ext for a whole NeMo-RL test session."""

from __future__ import annotations


def pytest_configure(config):
    from slime_ext.integrations import nemo_rl

    nemo_rl.enable()
    assert nemo_rl.enabled()
