"""slime-ext's benchmarks: each module with a ``main`` runs as ``python -m bench.<name>``; ``--quick`` is its smoke run.

Shared by every bench (read these first):

* :mod:`bench.workloads` -- the one workload registry: every sample length comes from a named distribution, a size
  and a seed there, with the named sets the benches run, the planning cases and the schemes compared;
* :mod:`bench.runner` -- one way to run and print: the argument parser, ``--set NAME=VALUE`` for ``PlannerConfig``
  fields, target lines and markdown tables;
* :mod:`bench.verdict` -- the verdict rule: PASS or FAIL over the cases measured, SKIP and why over none.

What the benches measure:

* **Plans** (no training): ``run`` (our planner against the legacy and reference schemes), ``plan_digest`` (the
  pinned plans: ``--check bench/plan_digests.json``; ``tests/unit/test_plan_digests.py`` runs the same check),
  ``plan_quality`` (whether moved plans got better);
* **The pipeline search** (predictions of the pipeline model): ``pipeline_search`` (the yardstick: a long search
  under the same model; ``pipeline_search_bests.json`` holds its bests), ``pipeline_speed`` (planning time;
  ``--model`` the model's own speed), ``log_probs`` (forward-only passes);
* **The pipeline model against megatron-core's schedule**: ``pipeline`` (sleep replay; ``--real`` real compute,
  :mod:`bench.pipeline_real`), ``pipeline_stages`` (uneven stages), ``schedule_replay`` (virtual time); the replay
  harness is :mod:`bench.pipeline_replay`, the stage pricing :mod:`bench.pipeline_costs`;
* **Real training**: ``train_step`` (a tiny GPT on CPU, every scheme), ``gpu_replay`` (a ~1B model on one GPU,
  ``ci/gpu_bench``);
* **Hosts' own planning, next to ours**: ``verl``, ``megatron_rl``.

Checks that are tests live in ``tests/`` (the GPU end-to-end check: ``tests/e2e/gpu_e2e.py``, run by
``ci/gpu_e2e`` and ``ci/gpu_all``). Figures the docs quote come from these commands (docs/benchmarks.md,
docs/pipeline.md).
"""
