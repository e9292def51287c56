"""``python -m slime_ext.run --config configs/demo_cpu.yaml``: the rollout -> train harness (see
:mod:`slime_ext.rollout.driver`)."""

from slime_ext.rollout.driver import main

if __name__ == "__main__":
    raise SystemExit(main())
