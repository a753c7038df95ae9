"""The engine: runs a cloudpickled function on ranks started in one Spark barrier stage.

Folders by the process that runs their modules: ``driver/`` (the caller of ``HorovodRunner.run``),
``task/`` (each Spark barrier task), ``rank/`` (each rank process) and ``launchers/`` (one module per
launcher and what they share, entered from the task side). The modules at this level import none of
those folders, and any of them may import these (``tests/unit/test_rooms.py``): the plan, the run's
spec, the wire, its messages and the channel's client, names, payload, options, events, records (what is saved, and the
layout), transfer (files between processes), hard links, timeline, dataset, the environment and
readiness checks, how a process ended (``exits``), Horovod's stall check, procs.

Nothing in this package imports Airflow.
"""
