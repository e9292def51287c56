"""The trainer depth against verl's real V1 trainer code: ``PPOTrainer._balance_batch`` (verl's and slime-ext's) on
verl's own ``KVBatchMeta``, in one process (the trainer runs in verl's driver; no Ray, no TransferQueue server: the
batch is already a multiple of the mini-batch size, so verl's padding step stores nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

tb = pytest.importorskip("verl.trainer.ppo.v1.trainer_base",
                         reason="verl's V1 trainer needs transferqueue, cachetools, uvicorn, fastapi: ci/verl_test "
                                "installs them (tests/verl/requirements.txt)")

DP, MINI_PROMPTS, N_PER_PROMPT, STEPS_MINI = 4, 8, 4, 4
MINI = MINI_PROMPTS * N_PER_PROMPT  # samples per actor mini-batch


def trainer(shuffle=False):
    from omegaconf import OmegaConf

    import verl.trainer.ppo.v1.trainer_sync  # noqa: F401  (registers "sync", the default trainer_mode)

    cls = tb.get_trainer_cls("sync")
    assert "_balance_batch" not in cls.__dict__  # it runs PPOTrainer's, the patched one
    t = cls.__new__(cls)
    t.config = OmegaConf.create({
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": MINI_PROMPTS, "shuffle": shuffle},
                              "rollout": {"n": N_PER_PROMPT}, "model": {"path": None}},
        "trainer": {"critic_warmup": 0}})
    t.use_critic, t.global_steps = False, 1
    t.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": [r for r in range(DP) for _ in range(2)]})
    t.tokenizer = SimpleNamespace(eos_token_id=2)
    return t


def lengths():
    rng = np.random.default_rng(3)
    return np.clip(rng.lognormal(6.5, 1.0, size=MINI * STEPS_MINI), 20, 16000).astype(int).tolist()


def batch():
    return tb.KVBatchMeta(keys=[f"s{i}" for i in range(MINI * STEPS_MINI)],
                          tags=[{"seq_len": L} for L in lengths()], partition_id="train")


def per_mini_batch_loads(result):
    """Tokens per rank (the plan's cost without a model path), for each mini-batch as verl's worker cuts it."""
    seq = np.array([t["seq_len"] for t in result.tags])
    chunks = seq.reshape(DP, -1)
    per = MINI // DP
    return [chunks[:, m * per:(m + 1) * per].sum(axis=1) for m in range(STEPS_MINI)]


@pytest.fixture
def patched():
    import slime_ext.integrations.verl as sv

    original = tb.PPOTrainer.__dict__["_balance_batch"]
    sv.enable("trainer")
    yield original
    sv.disable()
    assert tb.PPOTrainer.__dict__["_balance_batch"] is original


def test_trainer_depth_balances_every_mini_batch_and_keeps_verl_contract(patched):
    verl_metrics, ours_metrics = {}, {}
    verl_out = patched(trainer(), batch(), verl_metrics)
    ours_out = trainer()._balance_batch(batch(), ours_metrics)
    assert sorted(ours_out.keys) == sorted(verl_out.keys) and len(set(ours_out.keys)) == len(ours_out.keys)
    assert ours_metrics.keys() == verl_metrics.keys()  # verl's own unbalance metrics, on slime-ext's partition
    index = {f"s{i}": i for i in range(MINI * STEPS_MINI)}
    chunks = np.array([index[k] for k in ours_out.keys]).reshape(DP, -1)
    per = MINI // DP
    for m in range(STEPS_MINI):  # every rank's m-th slice comes from the step's m-th mini-batch
        assert set(chunks[:, m * per:(m + 1) * per].ravel()) == set(range(m * MINI, (m + 1) * MINI))
    seq = np.array(lengths())
    for m, (ours, verl) in enumerate(zip(per_mini_batch_loads(ours_out), per_mini_batch_loads(verl_out))):
        # no equal-count split beats the mean, nor the longest sample with the shortest others to fill its rank
        ranked = np.sort(seq[m * MINI:(m + 1) * MINI])
        bound = max(ranked.mean() * per, ranked[-1] + ranked[:per - 1].sum())
        assert ours.max() <= 1.05 * bound, (m, ours.max() / bound)
        assert ours.max() <= verl.max(), (m, ours.max(), verl.max())
    worst = [max(x.max() / x.mean() for x in per_mini_batch_loads(out)) for out in (ours_out, verl_out)]
    assert worst[0] < worst[1], worst


def test_shuffled_mini_batches_fall_back_to_verl(patched):
    verl_out = patched(trainer(shuffle=True), batch(), {})
    ours_out = trainer(shuffle=True)._balance_batch(batch(), {})
    assert ours_out.keys == verl_out.keys


def test_changed_balance_batch_is_refused(monkeypatch):
    import slime_ext.integrations.verl as sv
    from slime_ext.patches import PatchError

    monkeypatch.setattr(tb.PPOTrainer, "_balance_batch", lambda self, batch, metrics: batch)
    with pytest.raises(PatchError, match="its parameters are"):
        sv.enable("trainer")
    assert not sv.enabled("trainer")
    sv.disable()


PROBE = """
import json, verl
import verl.trainer.ppo.v1.trainer_base as tb
import verl.workers.engine.megatron.transformer_impl as ti
print(json.dumps({"trainer": getattr(tb.PPOTrainer._balance_batch, "__slime_ext__", False),
                  "engine": getattr(ti.prepare_micro_batches, "__slime_ext__", False)}))
"""


@pytest.mark.parametrize("value,expected", [("trainer", {"trainer": True, "engine": True}),
                                            ("1", {"trainer": False, "engine": True}),
                                            ("0", {"trainer": False, "engine": False})])
def test_switch_selects_the_depth_through_verl_plugins(value, expected):
    env = {**os.environ, "SLIME_EXT_VERL": value}
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == expected
