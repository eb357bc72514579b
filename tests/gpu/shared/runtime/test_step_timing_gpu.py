"""The step's GPU time window (GPU machine only).

bench_decode compares step_gpu_ms with a floor that counts the LM head's weight, so the
window must hold the LM head; forward_gpu_ms (the graph replay alone) must not. The bound
is physical: no kernel reads the head's weight faster than the HBM's peak (H200: 4.8 TB/s).
"""

from __future__ import annotations

import pytest

from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine

pytestmark = pytest.mark.gpu

PEAK_HBM_BYTES_PER_MS = 5.0e9  # above any current GPU's HBM bandwidth (5 TB/s)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_step_window_holds_the_lm_head(runner: str) -> None:
    from policy import EngineArgs

    args = EngineArgs(
        model="qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
        model_runner=runner, max_model_len=256, max_num_seqs=4, num_gpu_blocks_override=256,
    )
    engine = LLMEngine.from_engine_args(args)
    engine.add_request("r", list(range(1, 33)), SamplingParams(max_tokens=12, ignore_eos=True))
    gaps = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.step_stats
        fwd, step = stats.forward_gpu_ms(), stats.step_gpu_ms()
        if fwd is not None and step is not None and stats.cudagraph_mode == "FULL":
            gaps.append(step - fwd)
    head = engine.runner.executor.model.lm_head.weight
    head_ms = head.numel() * head.element_size() / PEAK_HBM_BYTES_PER_MS
    assert len(gaps) >= 5
    assert min(gaps) >= head_ms, (gaps, head_ms)
