"""The engine: runs a cloudpickled function on ranks started in one Spark barrier stage.

Folders by the process that runs their modules: ``driver/`` (the caller of ``HorovodRunner.run``),
``task/`` (each Spark barrier task), ``rank/`` (each rank process) and ``launchers/`` (one module per
launcher, entered from the task side). The modules at this level are shared by all of them: the plan,
the wire and its messages, names, payload, options, events, records (what is saved, and the layout),
transfer (files between processes), timeline, versions, dataset, procs.

Nothing in this package imports Airflow.
"""
