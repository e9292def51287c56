"""slime-ext's Megatron worker class as NeMo-RL resolves an actor class: its Python environment from NeMo-RL's
``ACTOR_ENVIRONMENT_REGISTRY`` (its own ``get_actor_python_env``), the ``worker_extension_cls_fqn`` slot of its real
``Policy.__init__``, and, in a fresh interpreter as a Ray worker would, NeMo-RL's own
``RayWorkerBuilder.IsolatedWorkerInitializer.create_worker`` importing the class by its FQN and preparing the actor
(with ``ActorClass.options`` recorded instead of starting a Ray actor on a GPU).

Not run: the actor itself (``MegatronPolicyWorkerImpl.__init__`` builds the model on a GPU); its two parts, the
worker patch and ``use_variable_seq_lengths``, run in ``test_nemo_rl_train.py``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from slime_ext.integrations.nemo_rl.worker import WORKER_CLASS_FQN
from slime_ext.patches.nemo_rl_host import NEMO_RL_WORKER_FQN


@pytest.mark.parametrize("pad_to_longest", [False, True])
def test_nemo_rls_registry_gives_the_worker_class_the_megatron_workers_environment(pad_to_longest):
    from nemo_rl.distributed.ray_actor_environment_registry import get_actor_python_env

    from slime_ext.integrations import nemo_rl as integration

    integration.enable(pad_to_longest=pad_to_longest)
    try:
        if pad_to_longest:  # the opt-out: NeMo-RL's own workers, nothing registered
            with pytest.raises(ValueError, match="No actor environment registered"):
                get_actor_python_env(WORKER_CLASS_FQN)
        else:
            assert get_actor_python_env(WORKER_CLASS_FQN) == get_actor_python_env(NEMO_RL_WORKER_FQN)
    finally:
        integration.disable()
    with pytest.raises(ValueError, match="No actor environment registered"):
        get_actor_python_env(WORKER_CLASS_FQN)


def test_the_worker_class_lands_in_policy_inits_own_parameter():
    """Passed by position (left ``None``) or not at all, slime-ext's class reaches the ``worker_extension_cls_fqn``
    of NeMo-RL's real ``Policy.__init__`` signature."""
    from nemo_rl.models.policy.lm_policy import Policy

    from slime_ext.integrations.nemo_rl.runtime import _with_worker_class
    from slime_ext.patches.nemo_rl_host import worker_class_position

    signature = inspect.signature(Policy.__init__)
    position = worker_class_position(Policy.__init__)
    for args, kwargs in (((None,) * (position + 1), {}), (("tokenizer",), {})):
        args, kwargs = _with_worker_class(args, kwargs, position)
        bound = signature.bind("self", "cluster", "config", *args, **kwargs)
        assert bound.arguments["worker_extension_cls_fqn"] == WORKER_CLASS_FQN


RESOLVE = r"""
import json, sys
import nemo_rl_stubs
nemo_rl_stubs.install_for_worker_module()
if sys.argv[1] == "without-slime-ext":  # a worker environment that lacks slime-ext
    import importlib.abc
    class NoSlimeExt(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "slime_ext":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, NoSlimeExt())
import ray
from nemo_rl.distributed.worker_groups import RayWorkerBuilder
from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorkerImpl

class Prepared:  # what worker_class.options(**options) gives: .remote(...) records instead of starting an actor
    def __init__(self, actor_class, options):
        self.actor_class, self.options = actor_class, options
    def remote(self, *args, **kwargs):
        return self.actor_class, self.options, args, kwargs

ray.actor.ActorClass.options = lambda self, **options: Prepared(self, options)
initializer = RayWorkerBuilder.IsolatedWorkerInitializer.__ray_metadata__.modified_class
out = {}
for fqn in sys.argv[2:]:
    builder = initializer.__new__(initializer)
    builder.__init__(fqn, "config", tokenizer="tokenizer")
    try:
        actor_class, options, args, kwargs = builder.create_worker(
            None, 0, 1, runtime_env={"env_vars": {"RANK": "0"}, "py_executable": "python"}, name="worker")
    except Exception as exc:
        out[fqn] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    cls = actor_class.__ray_metadata__.modified_class
    out[fqn] = {"actor": isinstance(actor_class, ray.actor.ActorClass),
                "megatron": issubclass(cls, MegatronPolicyWorkerImpl),
                "classes": [c.__qualname__ for c in cls.__mro__[:3]],
                "options": {k: v for k, v in options.items() if k != "scheduling_strategy"},
                "args": list(args), "kwargs": kwargs}
print(json.dumps(out))
"""


def resolve(environment: str) -> dict:
    from conftest import HERE, TREE

    repo = os.path.dirname(os.path.dirname(HERE))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, TREE, HERE]), "NO_VCS_VERSION": "1"}
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", RESOLVE, environment, WORKER_CLASS_FQN,
                          NEMO_RL_WORKER_FQN], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_ray_worker_imports_the_worker_class_by_its_fqn():
    """NeMo-RL's own ``create_worker`` in a fresh interpreter: slime-ext's FQN gives a Ray actor class that is
    NeMo-RL's Megatron worker implementation with slime-ext's ``__init__``, prepared with exactly the options and
    arguments NeMo-RL's own Megatron worker gets (its ``configure_worker`` included)."""
    resolved = resolve("with-slime-ext")
    ours, theirs = resolved[WORKER_CLASS_FQN], resolved[NEMO_RL_WORKER_FQN]
    assert ours["actor"] and ours["megatron"] and theirs["actor"] and theirs["megatron"]
    assert ours["classes"][1].endswith("SlimeExtMegatronPolicyWorker")
    assert ours["classes"][2] == theirs["classes"][2] == "MegatronPolicyWorkerImpl"
    assert ours["options"] == theirs["options"] and ours["options"]["runtime_env"]["env_vars"]["RANK"] == "0"
    assert (ours["args"], ours["kwargs"]) == (theirs["args"], theirs["kwargs"])
    assert (ours["args"], ours["kwargs"]) == (["config"], {"tokenizer": "tokenizer"})


def test_a_worker_without_slime_ext_fails_with_what_the_driver_names():
    """Where the workers' environment lacks slime-ext, NeMo-RL's ``create_worker`` fails importing the FQN, with
    the message slime-ext's driver turns into one error naming the fixes (``missing_slime_ext_named``)."""
    from slime_ext.integrations.nemo_rl.settings import NemoRLSettingError
    from slime_ext.integrations.nemo_rl.worker import missing_slime_ext_named

    resolved = resolve("without-slime-ext")
    error = resolved[WORKER_CLASS_FQN]["error"]
    assert error.startswith("ModuleNotFoundError: No module named 'slime_ext")
    assert resolved[NEMO_RL_WORKER_FQN]["megatron"]  # NeMo-RL's own worker needs no slime-ext
    with pytest.raises(NemoRLSettingError, match="PYTHONPATH.*--pad-to-longest"):
        with missing_slime_ext_named(True):
            raise RuntimeError(error)  # as Ray re-raises a worker's error in the driver: its text
