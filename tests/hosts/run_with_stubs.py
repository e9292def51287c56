"""``python run_with_stubs.py MODULE ARGS...``: run a module as ``__main__`` with the GPU-serving stubs installed
(the host tests start slime-ext's launcher on slime's real ``train.py`` this way). Calls into the stubs are inert
here: slime's parser registers SGLang's router flags through sglang_router at every start (v0.2.4, v0.3.0)."""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_stubs  # noqa: E402

gpu_stubs.install()
module, *rest = sys.argv[1:]
sys.argv = [module, *rest]
with gpu_stubs.inert_calls():
    runpy.run_module(module, run_name="__main__", alter_sys=True)
