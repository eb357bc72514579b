"""The async output on CUDA: copies on a side stream into the pinned ring. With a ring of
one slot, a second output reuses the first one's buffers; the first, read afterwards,
still has its own tokens (the reuse materialised it first), and both equal the device
tensors they were copied from, with the main stream busy meanwhile."""

from __future__ import annotations

import pytest
import torch

from shared.contract.step import ModelRunnerOutput
from shared.runtime.async_output import AsyncModelRunnerOutput, PinnedOutputRing, fill_sampled_output

pytestmark = pytest.mark.gpu


def _output(sampled: torch.Tensor, stream, ring) -> AsyncModelRunnerOutput:
    n = sampled.shape[0]
    out = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
    fill = lambda o, h: fill_sampled_output(o, h, [True] * n, [-1] * n)  # noqa: E731
    return AsyncModelRunnerOutput(out, {"sampled": sampled}, fill, stream, ring)


def test_ring_reuse_keeps_every_output_intact():
    stream, ring = torch.cuda.Stream(), PinnedOutputRing(depth=1)
    big = torch.randn(4096, 4096, device="cuda")
    outputs, expected = [], []
    for i in range(6):
        sampled = torch.randint(0, 50000, (257,), device="cuda") + i
        expected.append(sampled.tolist())
        big = big @ big  # keep the main stream busy while the copy is queued
        outputs.append(_output(sampled, stream, ring))
        del sampled  # only the output keeps the device tensor alive now
    for out, want in zip(outputs, expected):
        assert [t[0] for t in out.get_output().sampled_token_ids] == want
