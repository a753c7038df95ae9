"""The task side: what each Spark barrier task runs, in phases (``barrier.py``) and how rank 0's checkpoint
versions leave its task while training goes on (``shipper.py``). Runs in a Spark Python worker."""
