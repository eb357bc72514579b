"""V1 input prep on CUDA (GPU machine only): the same random step on CPU and CUDA gives
the same inputs, with pinned host buffers and non-blocking copies. The CPU tests, and the
helpers used here, are in tests/runner_v1/test_prepare_inputs.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_v1.prepare_inputs import prepare_inputs
from tests.runner_v1.test_prepare_inputs import make_batch, random_step

pytestmark = pytest.mark.gpu


def test_cuda_matches_cpu_with_pinned_non_blocking_copies():
    results = {}
    for device in ("cpu", "cuda"):
        rng = np.random.default_rng(0)
        batch, buffers = make_batch(8, 32, 256, 4, device)
        assert batch.temperature.cpu.is_pinned()  # CUDA exists: host buffers are pinned
        requests, num_scheduled = random_step(rng, batch, buffers, 6, 4, "g")
        out = prepare_inputs(batch, np.array(num_scheduled, np.int32), buffers,
                             sum(num_scheduled) + 3, 7)
        md = batch.refresh_sampling_metadata()
        torch.cuda.synchronize()
        fields = ("query_start_loc", "seq_lens", "positions", "input_ids", "slot_mapping",
                  "logits_indices")
        results[device] = [getattr(out, f).cpu().tolist() for f in fields] + [
            md.temperature.cpu().tolist(), md.seeds.cpu().tolist(),
            batch.block_table.block_table.gpu[:7].cpu().tolist()]
        if device == "cuda":
            assert out.input_ids.is_cuda and md.temperature.is_cuda
    assert results["cuda"] == results["cpu"]
