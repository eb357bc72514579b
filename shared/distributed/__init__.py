"""Tensor parallelism on torch.distributed: the group a model is built for and the
collectives its layers call (group.py), how a process joins that group (init.py), and the
host messages rank 0 sends the other ranks (channel.py)."""
