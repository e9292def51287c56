"""A pytest plugin for running Megatron-LM's own RL unit tests with slime-ext installed and imported, switch off.

``python -m pytest <tree>/tests/unit_tests/rl/test_sequence_packing_utils.py --noconftest -p mrl_slime_ext_loaded``:
imports slime-ext (and its Megatron-RL integration where it exists, without switching it on) before the tests are
collected, checks at the end that Megatron-RL's packing functions are still Megatron-LM's own, and says so.
"""

from __future__ import annotations

import importlib
import importlib.util

import slime_ext
import slime_ext.patches.megatron_cpu  # noqa: F401 -- imported, not applied

INTEGRATION = "slime_ext.integrations.megatron_rl"
if importlib.util.find_spec(INTEGRATION) is not None:
    importlib.import_module(INTEGRATION)

#: Megatron-RL functions the integration hooks (shared/notes/megatron-rl.md); with the switch off they are upstream's
WATCHED = (("megatron.rl.rl_utils", "prepare_data_for_update"), ("megatron.rl.rl_utils", "get_grpo_data_iterator"),
           ("megatron.rl.sequence_packing_utils", "pack_all_trajectories"),
           ("megatron.rl.sequence_packing_utils", "update_microbatch_calculator"),
           ("megatron.rl.sequence_packing_utils", "get_microbatch_dataloader"))


def pytest_terminal_summary(terminalreporter):
    foreign = []
    for module, name in WATCHED:
        fn = getattr(importlib.import_module(module), name, None)
        if fn is not None and not getattr(fn, "__module__", "").startswith("megatron."):
            foreign.append(f"{module}.{name} -> {fn.__module__}")
    if foreign:
        raise RuntimeError(f"slime-ext's switch is off but Megatron-RL functions are replaced: {foreign}")
    terminalreporter.write_line(f"slime-ext loaded from {slime_ext.__file__}; switch off: Megatron-RL's packing "
                                f"functions are Megatron-LM's own")
