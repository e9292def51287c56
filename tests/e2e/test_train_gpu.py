"""GPU variant: one rank on one GPU with NCCL against the single-GPU reference (skipped without CUDA).

NCCL refuses two ranks on one device, so multi-rank layouts need as many GPUs as ranks; this runs every layout
that fits ``torch.cuda.device_count()``.
"""

from __future__ import annotations

import pytest
import torch
from test_train_invariance import DYNAMIC, REFERENCE_CONFIG, check_invariance, check_ledger, rollout_scenario
from train_harness import group_job, launch, make_samples, reference_job, rendezvous

pytestmark = [pytest.mark.e2e, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("parallel, world_size", [
    pytest.param({}, 1, id="dp1"),
    pytest.param({}, 2, id="dp2"),
    pytest.param(dict(pipeline_model_parallel_size=2), 2, id="pp2"),
])
def test_gpu_nccl_matches_the_reference(parallel, world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    samples = [make_samples(10, seed=1)]
    sc = rollout_scenario("dynamic_balanced", samples, dict(DYNAMIC, use_dynamic_global_batch_size=True,
                                                            balance_data=True), parallel, world_size)
    config = {**REFERENCE_CONFIG, **parallel, "dist_backend": "nccl"}
    with rendezvous() as port:
        jobs = [(group_job, (rank, world_size, port, config, [sc.job])) for rank in range(world_size)]
        *group, reference = launch(jobs + [(reference_job, (REFERENCE_CONFIG, [sc.reference]))],
                                   timeout=300, gpu=True)
    check_invariance(group, reference, sc)
    check_ledger(group, sc)
