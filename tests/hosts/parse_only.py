"""Stands in for slime's ``train.py`` after its first line: slime's real ``parse_args()``, then print what it
parsed (the host tests run it under slime-ext's launcher, from the slime tree's root)."""

import json

from slime.utils.arguments import parse_args

KEYS = ("dp_schedule", "use_dynamic_global_batch_size", "disable_rollout_trim_samples", "balance_by_flops",
        "balance_data", "global_batch_size", "custom_megatron_init_path", "slime_ext_user_megatron_init_path")

if __name__ == "__main__":
    args = parse_args()
    print("SLIME_ARGS_JSON " + json.dumps({k: getattr(args, k, "<missing>") for k in KEYS}))
