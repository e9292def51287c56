"""What the NeMo-RL host tests share: a Megatron policy config, a ``Policy`` whose sharding runs without its Ray
workers, and traceable rollouts (row ``i`` holds token ``i + 1``)."""

from __future__ import annotations

import random

import numpy as np

CAP_TRAIN, CAP_LOGPROB, PAD = 512, 1024, 8


def policy_config(pp: int = 1) -> dict:
    return {
        "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": pp,
                         "context_parallel_size": 1, "sequence_parallel": False},
        "sequence_packing": {"enabled": True, "train_mb_tokens": CAP_TRAIN, "logprob_mb_tokens": CAP_LOGPROB,
                             "algorithm": "modified_first_fit_decreasing"},
        "dynamic_batching": {"enabled": False},
        "make_sequence_length_divisible_by": PAD,
        "train_global_batch_size": 32,
        "train_micro_batch_size": 1,
    }


def make_policy(cfg: dict, dp: int):
    from nemo_rl.distributed.named_sharding import NamedSharding
    from nemo_rl.models.policy.lm_policy import Policy

    from slime_ext.integrations.nemo_rl import enabled
    from slime_ext.integrations.nemo_rl.runtime import LAYOUT_ATTRIBUTE
    from slime_ext.integrations.nemo_rl.settings import layout_from_config

    pp = cfg["megatron_cfg"]["pipeline_model_parallel_size"]
    policy = Policy.__new__(Policy)
    policy.cfg = cfg
    policy.sharding_annotations = NamedSharding(np.arange(pp * dp).reshape(pp, dp, 1, 1, 1),
                                                ["pipeline_parallel", "data_parallel", "context_parallel",
                                                 "tensor_parallel", "expert_parallel"])
    policy.use_dynamic_batches = False
    policy.use_sequence_packing = True
    policy.sequence_packing_args = {"algorithm": cfg["sequence_packing"]["algorithm"], "input_key": "input_ids",
                                    "input_lengths_key": "input_lengths",
                                    "sequence_length_pad_multiple": cfg["make_sequence_length_divisible_by"]}
    if enabled():
        from slime_ext.integrations.nemo_rl.runtime import STATE

        setattr(policy, LAYOUT_ATTRIBUTE, layout_from_config(cfg, STATE.options.pad_to_longest))
    return policy


def rollouts(n: int, seed: int = 0, longest: int = 300):
    """A batch whose row ``i`` holds token ``i + 1`` in every real position (0 is padding): rows stay traceable."""
    import torch
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    rng = random.Random(seed)
    lengths = [rng.randint(5, longest) for _ in range(n)]
    width = max(lengths)
    ids = torch.zeros((n, width), dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, :length] = i + 1
    mask = (ids > 0).float()
    return BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor(lengths), "token_mask": mask,
                            "sample_mask": torch.ones(n)}), lengths
