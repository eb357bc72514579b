"""The async output's pinned ring: a slot is reused only after its previous owner has
been materialised, so an output nobody has read yet keeps its tokens whatever the
ring's depth; the per-key buffers grow by powers of two and keep their dtype."""

from __future__ import annotations

import torch

from shared.contract.step import ModelRunnerOutput
from shared.runtime.async_output import (
    AsyncModelRunnerOutput,
    PinnedOutputRing,
    _host_buffer,
    fill_sampled_output,
)


class _Owner:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def materialize(self) -> None:
        self.log.append(self.name)


def test_reusing_a_slot_materialises_its_previous_owner_first():
    log: list[str] = []
    ring = PinnedOutputRing(depth=2)
    a, b, c, d = (_Owner(log, n) for n in "abcd")
    slot_a = ring.take(a)
    ring.take(b)
    assert log == []  # two slots, two owners: nothing reused yet
    assert ring.take(c) is slot_a and log == ["a"]
    ring.take(d)
    assert log == ["a", "b"]


def test_host_buffer_grows_by_powers_of_two_and_follows_the_dtype():
    slot: dict[str, torch.Tensor] = {}
    v = _host_buffer(slot, "x", torch.zeros(5, dtype=torch.int64))
    assert v.shape == (5,) and slot["x"].numel() == 8
    first = slot["x"]
    _host_buffer(slot, "x", torch.zeros(2, 4, dtype=torch.int64))  # 8 fits: reused
    assert slot["x"] is first
    _host_buffer(slot, "x", torch.zeros(9, dtype=torch.int64))
    assert slot["x"].numel() == 16
    w = _host_buffer(slot, "x", torch.zeros(3, dtype=torch.float32))
    assert w.dtype == torch.float32


def test_fill_drops_partial_prefill_rows_and_unrequested_logprobs():
    out = ModelRunnerOutput(req_ids=["a", "b", "c"], req_id_to_index={}, sampled_token_ids=[])
    host = {"sampled": torch.tensor([7, 8, 9]), "ids": torch.tensor([[7, 1, 2], [8, 3, 4], [9, 5, 6]]),
            "lps": torch.tensor([[-1.0, -2.0, -3.0]] * 3), "ranks": torch.tensor([1, 2, 3])}
    fill_sampled_output(out, host, [True, False, True], [2, 1, -1])
    assert out.sampled_token_ids == [[7], [], [9]]
    assert out.logprobs[1] is None and out.logprobs[2] is None
    assert out.logprobs[0].token_ids == [7, 1, 2] and out.logprobs[0].rank == 1


def test_cpu_output_fills_once_and_keeps_its_result():
    calls = []
    out = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[])

    def fill(o, h):
        calls.append(1)
        fill_sampled_output(o, h, [True], [-1])

    pending = AsyncModelRunnerOutput(out, {"sampled": torch.tensor([4])}, fill, None)
    assert pending.get_output().sampled_token_ids == [[4]]
    assert pending.get_output().sampled_token_ids == [[4]] and calls == [1]
