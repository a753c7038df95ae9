"""The engine: runs a cloudpickled function as a Horovod job in one Spark barrier stage.

Nothing in this package imports Airflow.
"""
