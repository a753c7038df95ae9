"""The Horovod view: an API app in Airflow's API server and a tab on the task-instance page."""
