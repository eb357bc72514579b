"""Joining and leaving a tensor-parallel group (shared/distributed/init.py), on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shared.distributed.init import (
    destroy_tp_group,
    free_port,
    init_tp_group,
    torchrun_env,
)
from tests.shared.distributed.two_ranks import two_ranks
from tests.shared.serving.tp_fakes import process_guard

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@pytest.fixture(autouse=True)
def guard():
    with process_guard(60):
        yield


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in (*TORCHRUN, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_torchrun_env_needs_every_variable(no_torchrun):
    assert torchrun_env() is None
    for name, value in TORCHRUN.items():
        no_torchrun.setenv(name, value)
    assert torchrun_env() == (1, 4, 1)
    no_torchrun.delenv("MASTER_PORT")
    assert torchrun_env() is None


def test_a_one_rank_group_joins_and_leaves_twice():
    for _ in range(2):  # leaving must let the same process join again (a second engine)
        group = init_tp_group(0, 1, init_method=f"tcp://127.0.0.1:{free_port()}",
                              device="cpu", timeout_s=10)
        try:
            assert (group.rank, group.world_size, group.distributed) == (0, 1, True)
            assert dist.get_backend(group.device_group) == "gloo"
            assert dist.get_backend(group.cpu_group) == "gloo"
            assert group.cpu_group is not group.device_group
            x = torch.tensor([1.5, -2.0])
            assert torch.equal(group.all_reduce(x.clone()), x)
            group.store.set("k", "v")
            assert group.store.get("k") == b"v"
        finally:
            destroy_tp_group(group)
        assert not dist.is_initialized()
        destroy_tp_group(group)  # idempotent


def _rank1_collectives(group) -> None:
    group.all_reduce(torch.tensor([10.0, 20.0]))
    dist.all_reduce(torch.tensor([7], dtype=torch.int64), group=group.cpu_group)
    group.store.set("from-1", "hello")
    dist.barrier(group=group.cpu_group)


def test_two_ranks_share_both_groups_and_the_store():
    with two_ranks(_rank1_collectives) as (group, child):
        assert (group.rank, group.world_size) == (0, 2)
        total = group.all_reduce(torch.tensor([1.0, 2.0]))
        assert total.tolist() == [11.0, 22.0]
        on_cpu = torch.tensor([5], dtype=torch.int64)
        dist.all_reduce(on_cpu, group=group.cpu_group)
        assert on_cpu.item() == 12
        dist.barrier(group=group.cpu_group)
        assert group.store.get("from-1") == b"hello"
    assert child.exitcode == 0
