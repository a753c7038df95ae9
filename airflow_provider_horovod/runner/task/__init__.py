"""The task side: what each Spark barrier task runs, in phases (``barrier.py``), how rank 0's checkpoint
versions leave its task while training goes on (``shipper.py``), the notices it gives its ranks and
the driver when it is told to terminate (``termination.py``), and what the OS says of its ranks when the
driver says stop (``rank_states.py``). Runs in a Spark Python worker."""
