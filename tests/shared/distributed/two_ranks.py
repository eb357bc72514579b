"""A two-rank gloo group on 127.0.0.1 for the distributed tests: rank 0 is the test's
process, rank 1 a spawned child that runs `child_fn(group)` (a module-level function,
imported by name in the child) and leaves."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.multiprocessing as mp

from shared.distributed.group import TPGroup
from shared.distributed.init import destroy_tp_group, free_port, init_tp_group

CHILD_MESSAGE_TIMEOUT_S = 60.0


def _child_main(child_fn: Callable[[TPGroup], None], init_method: str, timeout_s: float) -> None:
    group = init_tp_group(1, 2, init_method=init_method, device="cpu", timeout_s=timeout_s,
                          message_timeout_s=CHILD_MESSAGE_TIMEOUT_S)
    try:
        child_fn(group)
    finally:
        destroy_tp_group(group)


@contextlib.contextmanager
def two_ranks(child_fn: Callable[[TPGroup], None], *, timeout_s: float = 10.0,
              message_timeout_s: float | None = None) -> Iterator[tuple[TPGroup, object]]:
    """-> (rank 0's group, the child process); the group is left and the child reaped."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    child = mp.get_context("spawn").Process(target=_child_main, daemon=True,
                                            args=(child_fn, init_method, timeout_s))
    child.start()
    group = None
    try:
        group = init_tp_group(0, 2, init_method=init_method, device="cpu", timeout_s=timeout_s,
                              message_timeout_s=message_timeout_s)
        yield group, child
    finally:
        child.join(10)
        if child.exitcode is None:
            child.kill()
            child.join()
        if group is not None:
            destroy_tp_group(group)
