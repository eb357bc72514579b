"""On the GPU, the TRITON backend against the TORCH oracle through the whole engine:
qwen3-0.6b shape, dummy bf16 weights, greedy, 8 prompts x 16 tokens (GPU machine only).

bf16 can flip a greedy choice where two logits are within rounding of each other; the
test then reports that gap instead of hiding it, and fails on a real divergence (a
large gap)."""

from __future__ import annotations

import pytest
import torch

from shared.contract.outputs import PositionLogprobs
from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine

pytestmark = pytest.mark.gpu


def _run(backend: str) -> tuple[dict[str, list[int]], dict[str, list[PositionLogprobs]]]:
    from policy import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(
        model="qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
        model_runner="v1", attention_backend=backend, max_model_len=512, max_num_seqs=8,
        num_gpu_blocks_override=1024, enable_prefix_caching=False,
    ))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    for i in range(8):
        prompt = [(i * 97 + j * 31) % 5000 + 10 for j in range(10 + 9 * i)]
        engine.add_request(str(i), prompt, params)
    tokens, logprobs = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            logprobs[out.request_id] = out.outputs[0].logprobs
    del engine
    torch.cuda.empty_cache()
    return tokens, logprobs


def test_triton_equals_torch_greedy_bf16() -> None:
    triton_tokens, triton_lps = _run("TRITON")
    torch_tokens, _ = _run("TORCH")
    gaps = []
    for req_id, ref in torch_tokens.items():
        got = triton_tokens[req_id]
        if got == ref:
            continue
        pos = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
        # the TRITON run's logprob gap between its top two tokens where the runs split
        top = sorted((lp.logprob for lp in triton_lps[req_id][pos].values()), reverse=True)
        gaps.append((req_id, pos, top[0] - top[1]))
    print(f"TRITON vs TORCH bf16: {8 - len(gaps)}/8 requests identical; divergences "
          f"(request, position, top-2 logprob gap): {gaps}")
    # Dummy weights give a nearly flat distribution over 151,936 tokens, so the top two
    # logits are often within a few bf16 ulps (measured on the H200: gaps 0 to 0.125,
    # bf16 logits there step by 1/32 to 1/16). A flip between such near-ties is rounding;
    # an attention bug moves logprobs by whole units and splits at large gaps.
    assert all(gap <= 0.25 for _, _, gap in gaps), gaps
