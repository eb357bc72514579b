"""The V2 sampler compiled on CUDA (GPU machine only): identical tokens to the V1 PyTorch
sampler in float32 / float64 / bf16, and no host sync in a call. The interpreter tests,
and the helpers used here, are in tests/runner_v2/test_sampler.py and
tests/runner_v1/test_sampler.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner_v1.sampler import Sampler as V1Sampler
from runner_v2.sample import Sampler, SamplingStates
from shared.contract.sampling_params import SamplingParams
from tests.runner_v1.test_sampler import FEATURES, Row, make_metadata
from tests.runner_v2.test_sampler import add_rows, assert_same

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_compiled_triton_matches_v1_on_cuda(dtype: torch.dtype) -> None:
    vocab = 32_000
    rng = np.random.default_rng(14)
    rows = []
    for i, feature in enumerate(FEATURES):
        r = Row(
            SamplingParams(seed=int(rng.integers(0, 2**63)), max_tokens=64, **FEATURES[feature]),
            rng.integers(0, vocab, 20).tolist(),
            rng.integers(0, vocab, i).tolist(),
        )
        rows.append(r)
    logits = torch.from_numpy(rng.normal(0, 3, (len(rows), vocab))).to(dtype).cuda()
    md, positions = make_metadata(rows, vocab)
    md = _to_cuda(md)
    v1 = V1Sampler()(logits, md, positions.cuda())
    states = SamplingStates(64, vocab, "cuda")
    state_rows = rng.permutation(64)[: len(rows)].tolist()
    add_rows(states, state_rows, rows)
    idx = torch.tensor(state_rows, dtype=torch.int32, device="cuda")
    v2 = Sampler(states)(logits, idx, positions.cuda(), md.max_num_logprobs)
    assert_same(v2, v1)


def test_sampler_call_does_not_sync_on_cuda() -> None:
    vocab = 32_000
    rng = np.random.default_rng(15)
    rows = [Row(SamplingParams(seed=i, max_tokens=64, **FEATURES[f]), [1, 2, 3], [4] * i)
            for i, f in enumerate(FEATURES)]
    states = SamplingStates(64, vocab, "cuda")
    add_rows(states, list(range(len(rows))), rows)
    logits = torch.from_numpy(rng.normal(0, 3, (len(rows), vocab))).float().cuda()
    idx_np = np.arange(len(rows), dtype=np.int32)
    idx = torch.from_numpy(idx_np).cuda()
    positions = torch.tensor([r.pos for r in rows], dtype=torch.int64).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        Sampler(states)(logits, idx, positions, 4, idx_mapping_np=idx_np)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _to_cuda(md):
    from dataclasses import fields, replace

    moved = {
        f.name: getattr(md, f.name).cuda()
        for f in fields(md)
        if isinstance(getattr(md, f.name), torch.Tensor)
    }
    return replace(md, **moved)
