"""verl's ``verl.plugins`` entry point (``import verl`` loads it in every process, Ray workers included).

Reads the switch (``SLIME_EXT_VERL``) and, when it is on, arranges for slime-ext's patches to be applied when verl's
Megatron engine module is imported. verl swallows (at DEBUG level) any error a plugin raises while loading, so a bad
switch value is logged here and raised at that import instead, where it stops the job.
"""

from __future__ import annotations

import os

from . import ENV, enable_on_import, logger, switch_from_env


def _load() -> None:
    try:
        depth = switch_from_env()
    except ValueError as exc:
        logger.error("slime-ext: %s", exc)
        enable_on_import(error=exc)
        return
    if depth is not None:
        enable_on_import(depth)
        logger.info("slime-ext: %s=%s; verl will plan with slime-ext (%s depth)", ENV, os.environ.get(ENV), depth)


_load()
