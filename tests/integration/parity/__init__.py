"""A broad collective test module run with pytest inside Horovod ranks, to compare launchers."""
