"""The driver side: ``HorovodRunner`` drives attempts (``runner.py``) under the restart policy
(``restarts.py``, with ``capacity.py``: whether lost slots can come back); one attempt is one barrier
stage (``attempt.py``) whose every decision and deadline the supervisor owns (``supervisor.py``, its
stall rule ``stalls.py``), fed by the channel the tasks and ranks report to (``channel.py``) and by
Spark's decommission notices (``preemption.py``); the run's folder (``artifact_dir.py``) and the
checkpoint versions committed into it (``versions.py``); ``executors.py`` says what the executors
need. Runs in the process that calls ``run()`` (the Airflow task)."""
