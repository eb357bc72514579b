"""Tensor parallelism on torch.distributed: the group a model is built for and the
collectives its layers call (group.py), and how a process joins that group (init.py)."""
