"""One process of the gloo test of verl's ``prepare_micro_batches`` (tests/verl/test_prepare_micro_batches.py).

    python tests/verl/prepare_worker.py RANK WORLD INIT_FILE OUT_DIR

Imports verl as a job would (its ``verl.plugins`` entry points load, so ``SLIME_EXT_VERL`` decides whether
slime-ext's patch is applied), builds megatron-core's parallel groups over gloo for each layout, and on the same
batches calls verl's own function (``verl.workers.engine.utils.prepare_micro_batches``, which the patch never
touches) and the one verl's Megatron engine calls (``transformer_impl.prepare_micro_batches``). What each returned
is pickled to ``OUT_DIR/rank{RANK}.pkl`` for the test to judge.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback

import numpy as np
import torch
import torch.distributed as dist

#: (name, pipeline size, virtual pipeline size); with VPP verl passes num_batches_divided_by = the group = pp
LAYOUTS = (("dp", 1, None), ("dp-pp2", 2, None), ("dp-pp2-vpp2", 2, 2))
#: (name, lengths of the samples of DP rank r, cap, nested input_ids, use_dynamic_bsz)
CAP = 4096


def cases(dp_rank: int):
    rng = np.random.default_rng(1234 + dp_rank)
    longtail = np.clip(rng.lognormal(6.3, 1.0, size=16).astype(int), 16, CAP).tolist()
    bimodal = [int(x) for x in np.where(rng.random(16) < 0.25, rng.integers(2500, 4000, 16),
                                        rng.integers(50, 400, 16))]
    return [
        ("verl-over-cap", [6, 6, 6, 6] if dp_rank == 0 else [3, 3, 3, 3], 10, False, True),
        ("long-tail", longtail, CAP, True, True),
        ("bimodal", bimodal, CAP, False, True),
        ("uneven-counts", longtail[: 8 + 4 * dp_rank], CAP, True, True),
        ("static", [64] * 8, CAP, False, False),
        # a sample of no tokens on DP rank 1 only: slime-ext's planner refuses it there; every rank must raise
        # (after the one collective), none may hang
        ("one-rank-fails", [40, 0, 30] if dp_rank == 1 else [40, 50, 30], CAP, False, True),
    ]


def make_batch(lengths, cap, nested, dynamic):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    n = len(lengths)
    sample_id = torch.arange(n, dtype=torch.int64)
    if nested:
        ids = torch.nested.as_nested_tensor([torch.full((L,), i + 1, dtype=torch.int64) for i, L in enumerate(lengths)],
                                            layout=torch.jagged)
        td = TensorDict({"input_ids": ids, "sample_id": sample_id}, batch_size=[n])
    else:
        width = max(lengths)
        mask = torch.zeros(n, width, dtype=torch.int64)
        for i, L in enumerate(lengths):
            mask[i, :L] = 1
        td = TensorDict({"input_ids": mask * (sample_id[:, None] + 1), "attention_mask": mask,
                         "sample_id": sample_id}, batch_size=[n])
    tu.assign_non_tensor_data(td, "use_dynamic_bsz", dynamic)
    tu.assign_non_tensor_data(td, "sp_size", 1)
    if dynamic:
        tu.assign_non_tensor_data(td, "max_token_len_per_gpu", cap)
    else:
        tu.assign_non_tensor_data(td, "micro_batch_size_per_gpu", 2)
    return td


def tokens_of(mb) -> int:
    ids = mb["input_ids"]
    if ids.is_nested:
        return int(ids.offsets()[-1])
    return int(mb["attention_mask"].sum())


class CollectiveSpy:
    """Counts the torch.distributed collectives a call makes (by name), by wrapping them while it runs."""

    NAMES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast", "gather")

    def __init__(self):
        self.calls: dict[str, int] = {}

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self.saved.items():
            def counted(*args, _name=name, _fn=fn, **kwargs):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _fn(*args, **kwargs)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def call(fn, data, dp_group, divided_by):
    from verl.utils.seqlen_balancing import restore_dynamic_batch

    with CollectiveSpy() as spy:
        try:
            mbs, idx = fn(data, dp_group=dp_group, num_batches_divided_by=divided_by, same_micro_num_in_dp=True,
                          min_num_micro_batch=None)
        except Exception as exc:  # verl's own function asserts on some inputs; record what it said
            return {"error": f"{type(exc).__name__}: {exc}", "collectives": spy.calls}
    out = {"collectives": spy.calls, "count": len(mbs), "tokens": [tokens_of(mb) for mb in mbs],
           "sizes": [len(mb) for mb in mbs],
           "indices": None if idx is None else [list(map(int, x)) for x in idx],
           "ids": [mb["sample_id"].tolist() for mb in mbs]}
    if idx is not None:  # verl's own restore, as postprocess_batch_func does with the engine's outputs
        out["restored"] = restore_dynamic_batch(torch.cat([mb["sample_id"] for mb in mbs]), idx).tolist()
    return out


def main() -> None:
    rank, world, init_file, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import verl  # loads the verl.plugins entry points, as in a job

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_platform

    cpu_platform.install()
    import verl.workers.engine.megatron.transformer_impl as ti
    import verl.workers.engine.utils as eu
    from megatron.core import parallel_state as mpu

    result = {"verl": verl.__version__, "verl_file": verl.__file__,
              "patched": bool(getattr(ti.prepare_micro_batches, "__slime_ext__", False)),
              "engine_wrapped": hasattr(ti.MegatronEngine.forward_backward_batch, "__wrapped__"),
              "same_as_utils": ti.prepare_micro_batches is eu.prepare_micro_batches, "runs": []}
    try:
        for layout, pp, vpp in LAYOUTS:
            mpu.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
            group, dp_rank = mpu.get_data_parallel_group(), mpu.get_data_parallel_rank()
            divided_by = pp if vpp else None
            for name, lengths, cap, nested, dynamic in cases(dp_rank):
                data = make_batch(lengths, cap, nested, dynamic)
                result["runs"].append({
                    "layout": layout, "case": name, "dp_rank": dp_rank,
                    "pp_rank": mpu.get_pipeline_model_parallel_rank(),
                    "dp_size": mpu.get_data_parallel_world_size(), "cap": cap, "lengths": lengths,
                    "divided_by": divided_by, "dynamic": dynamic,
                    "verl": call(eu.prepare_micro_batches, data, group, divided_by),
                    "engine": call(ti.prepare_micro_batches, data, group, divided_by),
                })
            mpu.destroy_model_parallel()
    except Exception:
        result["crash"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
