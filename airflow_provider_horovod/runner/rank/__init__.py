"""The rank side: the rank process (``worker.py``, ``python -m airflow_provider_horovod.runner.rank.worker``)
and what it runs beside the training function: rank 0's report sender (``reports.py``), the stall
watch and stacks on demand (``stacks.py``), the preemption notice (``preemption.py``), the Keras 3
and Horovod guards (``keras_guard.py``, ``horovod_guard.py``) and the dataset shard reader (``shard.py``)."""
