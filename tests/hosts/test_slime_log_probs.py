"""slime's log-prob passes under ``--log-probs-max-tokens-per-gpu``, inside real slime at every supported tag (see
conftest.py for how to run them; ``tests/hosts/slime_probe.py log_probs`` does the work).

slime's real split, ``process_rollout_data``, ``get_data_iterator`` and ``MegatronTrainRayActor.compute_log_prob``
(patched by slime-ext's ``megatron_init`` hook), with slime's ``forward_only`` recorded instead of run:

* the cap set apart: both passes (reference, actor) walk a plan of their own, one forward-only step of the same
  count on every DP rank, every sample of the rank once, no micro-batch of several samples over the cap, every
  virtual stage alike, in an order slime's ``forward_only`` can put back (a permutation of the rank's samples);
* unset (slime sets it to ``--max-tokens-per-gpu``), before and after the patch is in place: the passes walk the
  training plan's micro-batches and counts exactly.
"""

from __future__ import annotations

from collections import Counter

import pytest
from probe_runs import run_probe

pytestmark = pytest.mark.timeout(1800)


def _walked(log_pass: dict) -> list[list[int]]:
    """The micro-batches a pass walked (its first virtual stage), every step in turn."""
    return [mb for step in log_pass["stages"][0] for mb in step]


@pytest.mark.parametrize("case", ["multi_sample", "vpp2"])
def test_log_probs_cap_set_apart_plans_the_passes_apart_and_unset_changes_nothing(slime_env, case):
    out = run_probe(slime_env, "log_probs")[case]
    if "skip" in out:
        pytest.skip(out["skip"])
    assert out["target"] == "slime.backends.megatron_utils.actor.MegatronTrainRayActor.compute_log_prob"
    cap, lengths = out["cap"], out["lengths"]
    # unset: the training plan's micro-batches and counts, bit for bit, with and without the patch in place
    assert not out["unset_patched"]
    for run in ("unset", "unset_through_patch"):
        for rank in out[run]:
            assert [p["prefix"] for p in rank["passes"]] == ["ref_", ""]
            for log_pass in rank["passes"]:
                assert log_pass["counts"] == rank["training_counts"], run
                assert _walked(log_pass) == rank["training"], run
    # set apart: one forward-only step, one count on every rank, the rank's own samples once each, under the cap
    counts = {tuple(p["counts"]) for rank in out["apart"] for p in rank["passes"]}
    assert len(counts) == 1 and len(next(iter(counts))) == 1, counts
    (count,) = next(iter(counts))
    if out["vpp"] > 1:
        assert count % out["mb_group"] == 0
    differs = False
    for rank in out["apart"]:
        ref, actor = rank["passes"]
        assert _walked(ref) == _walked(actor)  # one plan for both passes
        walked = _walked(actor)
        assert len(walked) == count and all(stage == actor["stages"][0] for stage in actor["stages"])
        assert Counter(i for mb in walked for i in mb) == Counter(i for mb in rank["training"] for i in mb)
        assert all(sum(lengths[i] for i in mb) <= cap for mb in walked if len(mb) > 1)
        assert sorted(actor["order"]) == list(range(rank["local_samples"]))  # what forward_only puts back
        differs |= walked != rank["training"]
    assert differs, "the cap set apart planned what the training plan already was"
