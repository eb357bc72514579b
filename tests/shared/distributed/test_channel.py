"""Rank 0 -> worker messages and the busy posts (shared/distributed/channel.py), on gloo."""

from __future__ import annotations

import time
import zlib

import pytest

from shared.distributed.channel import (
    HEADER_BYTES,
    ChannelError,
    HostChannel,
    busy_ranks,
    post_busy,
)
from tests.shared.distributed.two_ranks import two_ranks
from tests.shared.serving.tp_fakes import process_guard


@pytest.fixture(autouse=True)
def guard():
    with process_guard(60):
        yield


def crc(message: object) -> int:
    return zlib.crc32(repr(message).encode())


def messages() -> list[object]:
    # sizes on both sides of the header's capacity, and one many headers long
    near = [b"x" * n for n in range(HEADER_BYTES - 40, HEADER_BYTES + 10, 7)]
    return [("step", 1, {"a": [1, 2, 3]}), b"", *near, list(range(200_000)), "stop"]


def _echo_crcs(group) -> None:
    channel = HostChannel(group, timeout_s=10)
    while (message := channel.recv()) != "stop":
        channel.gather_int(crc(message))
    post_busy(group, "load_model", 7, time.time() - 3)
    channel.gather_int(0)
    channel.gather_int(0)  # rank 0 reads the post in between
    post_busy(group, None)
    channel.gather_int(0)


def test_messages_of_every_size_arrive_whole_and_in_order():
    with two_ranks(_echo_crcs) as (group, child):
        channel = HostChannel(group, timeout_s=10)
        for message in messages():
            channel.send(message)
            if message != "stop":
                assert channel.gather_int(crc(message)) == [crc(message)] * 2
        channel.gather_int(0)
        busy = busy_ranks(group)
        assert busy.keys() == {1}
        assert busy[1].startswith("busy in load_model (message 7) for 3.")
        channel.gather_int(0)
        channel.gather_int(0)
        assert busy_ranks(group) == {}
    assert child.exitcode == 0


def _never_listen(group) -> None:
    time.sleep(8)


def test_a_rank_that_does_not_listen_is_named_within_the_timeout():
    with two_ranks(_never_listen, message_timeout_s=1.0) as (group, child):
        channel = HostChannel(group, timeout_s=1.0)
        start = time.monotonic()
        with pytest.raises(ChannelError, match="did not all report within 1 s") as info:
            channel.gather_int(1)
        assert info.value.rank is None and time.monotonic() - start < 3
        with pytest.raises(ChannelError) as info:
            channel.send(("step", 2, "x"))
        assert info.value.rank == 1 and "rank 1" in str(info.value)
        child.kill()
