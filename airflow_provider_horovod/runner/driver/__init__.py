"""The driver side: ``HorovodRunner`` drives attempts (``runner.py``); one attempt is one barrier
stage (``attempt.py``) whose every decision and deadline the supervisor owns (``supervisor.py``),
fed by the channel the tasks and ranks report to (``channel.py``); ``executors.py`` says what the
executors need. Runs in the process that calls ``run()`` (the Airflow task)."""
