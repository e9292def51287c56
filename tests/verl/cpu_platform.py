"""A CPU platform for verl, registered through verl's own platform registry (``verl.plugin.platform``), so that
verl's ``get_device_name()`` says ``cpu`` on a machine without an accelerator (verl 0.9 falls back to ``nvidia``
there, and its collectives then ask for CUDA tensors). Test support only: a GPU job uses verl's own platforms."""

from __future__ import annotations

import contextlib


def install() -> None:
    """Make verl's platform the CPU one; call before anything asks verl for its device."""
    import torch
    from verl.plugin.platform import platform_manager as pm
    from verl.plugin.platform.platform_base import PlatformBase

    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self):
            return True

        def current_device(self):  # verl moves batches with .to(get_device_id()): a CPU device, not an index
            return torch.device("cpu")

        def device_count(self):
            return 1

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    pm.set_platform(CPUPlatform())
