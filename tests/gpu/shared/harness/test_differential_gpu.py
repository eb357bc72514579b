"""The scenario library on the GPU: V1 and V2 in float32 on CUDA (TRITON attention, FULL
graphs for uniform decode, the UVA token table in V2) must give identical tokens and
logprobs in every scenario, and return every KV block (GPU machine only)."""

from __future__ import annotations

import pytest

from shared.harness.diff import run_diff
from shared.harness.scenarios import SCENARIOS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("seed", [0, 1])
def test_every_scenario_v1_equals_v2_float32_cuda(seed: int) -> None:
    reports = run_diff("tiny-llama", "float32", "cuda", list(SCENARIOS), [seed], ["v1", "v2"])
    failing = [(r.name, r.error, [p for p in r.pairs if not p.agrees]) for r in reports
               if not r.agrees]
    assert not failing, failing
