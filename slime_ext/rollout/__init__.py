"""The rollout adapter (Ray): rollouts -> train data -> the schedule -> one payload per DP rank -> train actors.

One concern per module:

* :mod:`.types` -- ``Sample``, what a rollout function returns;
* :mod:`.synthetic` -- the default rollout function, a seeded synthetic generator;
* :mod:`.train_data` -- samples -> one ``SampleBatch`` (advantages, loss masks);
* :mod:`.dispatch` -- **where the schedule is computed**: train data -> a ``RankPayload`` per DP rank (or legacy split);
* :mod:`.config` -- the run config (one YAML: training keys + rollout/harness keys), validated before any process;
* :mod:`.actors` -- the Ray actors: ``RolloutManager`` and ``TrainActor`` (wraps a ``TrainWorker``);
* :mod:`.harness` -- what both launchers share: the ranks' environment, the result records, the step table, the
  ledger check at the end of each rollout;
* :mod:`.driver` -- the harness: starts Ray on loopback, runs rollout -> train steps, prints them, shuts down;
* :mod:`.processes` -- the same harness without Ray (``launcher: processes``): ``torch.multiprocessing`` ranks;
  the driver hands ``launcher: processes`` to it (one way: it imports :mod:`.harness`, never the driver).

Only :mod:`.actors` and :mod:`.driver` import Ray, and only when ``launcher: ray`` runs; the planning layer never
imports this package.
"""
