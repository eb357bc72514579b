"""Rank 0 -> every other rank: pickled host messages over the group's CPU (gloo) group,
and the busy status the workers post to the rendezvous store.

A message is one fixed-size header send per worker ([8-byte length][the first bytes of the
pickle]) and, only when the pickle does not fit, a second send of the rest: a decode
step's SchedulerOutput fits the header, so a step costs one send per worker. Rank 0 sends
to each worker on its own (rather than one broadcast) so that a send that fails or times
out names the rank it was for; each send is waited on with a deadline, so a dead or hung
worker becomes a ChannelError within the timeout, never a hang.
"""

from __future__ import annotations

import json
import pickle
import struct
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shared.distributed.group import TPGroup

HEADER_BYTES = 16 * 1024
_LEN = struct.Struct("<Q")
_HEAD_TAG, _REST_TAG = 1, 2


class ChannelError(RuntimeError):
    """A send to `rank` (None: a collective of all ranks) failed or timed out."""

    def __init__(self, rank: int | None, message: str):
        super().__init__(message)
        self.rank = rank


class HostChannel:
    def __init__(self, group: TPGroup, timeout_s: float):
        self.group = group
        self.timeout_s = timeout_s
        self._header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)

    # ---- rank 0 ---------------------------------------------------------------------
    def send(self, message: Any) -> None:
        """Pickle `message` and hand it to every other rank, each within timeout_s."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        room = HEADER_BYTES - _LEN.size
        head = self._header.numpy()  # reused: the previous sends have all completed
        _LEN.pack_into(head, 0, len(payload))
        head[_LEN.size:_LEN.size + min(len(payload), room)] = np.frombuffer(payload[:room], np.uint8)
        rest = None
        if len(payload) > room:
            rest = torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8)
        deadline = time.monotonic() + self.timeout_s
        works = []
        for rank in range(1, self.group.world_size):
            try:
                works.append((rank, dist.isend(self._header, rank, self.group.cpu_group,
                                               tag=_HEAD_TAG)))
                if rest is not None:
                    works.append((rank, dist.isend(rest, rank, self.group.cpu_group,
                                                   tag=_REST_TAG)))
            except RuntimeError as err:
                raise ChannelError(rank, f"the send to rank {rank} failed: {err}") from err
        for rank, work in works:
            self._wait(work, deadline, rank, f"rank {rank} did not take the message")

    def gather_int(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order (all ranks call it; rank 0 with a deadline)."""
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.group.world_size)]
        work = dist.all_gather(out, torch.tensor([value], dtype=torch.int64),
                               group=self.group.cpu_group, async_op=True)
        if self.group.rank == 0:
            self._wait(work, time.monotonic() + self.timeout_s, None,
                       "the ranks did not all report")
        else:
            work.wait()  # the CPU group's own (long) timeout
        return [int(t.item()) for t in out]

    def _wait(self, work: Any, deadline: float, rank: int | None, what: str) -> None:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timeout=timedelta(seconds=left))
        except RuntimeError as err:
            raise ChannelError(rank, f"{what} within {self.timeout_s:g} s: {err}") from err

    # ---- the other ranks --------------------------------------------------------------
    def recv(self) -> Any:
        """The next message from rank 0 (waits on the CPU group's timeout)."""
        dist.recv(self._header, 0, self.group.cpu_group, tag=_HEAD_TAG)
        head = self._header.numpy()
        (size,) = _LEN.unpack_from(head, 0)
        room = HEADER_BYTES - _LEN.size
        data = head[_LEN.size:_LEN.size + min(size, room)].tobytes()
        if size > room:
            rest = torch.empty(size - room, dtype=torch.uint8)
            dist.recv(rest, 0, self.group.cpu_group, tag=_REST_TAG)
            data += rest.numpy().tobytes()
        return pickle.loads(data)


# ---- busy status ----------------------------------------------------------------------
# A worker whose call has run for a while posts it; rank 0 reads the posts when a
# collective times out, to name the rank that is stuck. Posting only long calls keeps the
# store out of the per-step path.
def _busy_key(rank: int) -> str:
    return f"busy/{rank}"


def post_busy(group: TPGroup, what: str | None, message: int = 0, since: float = 0.0) -> None:
    """Post that this rank has been in `what` (message number `message`) since the
    wall-clock time `since`, or withdraw the post (what=None). A lost store is ignored."""
    store, rank = group.store, group.rank
    if store is None:
        return
    try:
        if what is None:
            store.delete_key(_busy_key(rank))
        else:
            store.set(_busy_key(rank), json.dumps([what, message, since]))
    except Exception:  # noqa: BLE001 (rank 0 and its store are gone; nothing to tell)
        pass


def busy_ranks(group: TPGroup) -> dict[int, str]:
    """rank -> what it has posted being busy with, in words (only the ranks that posted)."""
    store, world_size = group.store, group.world_size
    found: dict[int, str] = {}
    if store is None:
        return found
    for rank in range(1, world_size):
        try:
            if store.check([_busy_key(rank)]):
                what, message, since = json.loads(store.get(_busy_key(rank)))
                found[rank] = f"busy in {what} (message {message}) for {time.time() - since:.1f} s"
        except Exception:  # noqa: BLE001 (a diagnosis must not raise over the real error)
            pass
    return found
