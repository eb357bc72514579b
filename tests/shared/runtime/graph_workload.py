"""The mixed workload the CUDA-graph tests of both runners drive (on CPU with eager
stand-ins, on the GPU for real): requests arriving at given steps while others decode,
each step's graph mode read from the runner's step stats, and the KV slots a step wrote.
"""

from __future__ import annotations

import torch

from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine

Steps = list[tuple[int, int, str]]  # (num_reqs, num_tokens, cudagraph_mode) per step that ran


def prompt(step: int, i: int, n: int) -> list[int]:
    """The prompt of the i-th request arriving at `step`, n tokens, all < 501 (every
    preset's vocabulary is larger)."""
    return [(step * 131 + i * 17 + j * 7) % 500 + 1 for j in range(n)]


def run_workload(
    engine: LLMEngine, arrivals: dict[int, list[int]], max_tokens: int
) -> tuple[dict[str, list[int]], Steps]:
    """Greedy, ignore_eos: `arrivals` maps a step index to the prompt lengths added before
    that step. -> (tokens per request, (num_reqs, num_tokens, mode) of each step that ran)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    steps: Steps = []
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i, n in enumerate(arrivals.get(step, [])):
            engine.add_request(f"s{step}-{i}", prompt(step, i, n), params)
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        stats = engine.runner.step_stats
        if stats.num_tokens:
            steps.append((stats.num_reqs, stats.num_tokens, stats.cudagraph_mode))
        step += 1
    return tokens, steps


def changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    """KV slots (block * block_size + offset) whose K or V changed in any layer; caches
    laid out [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    changed = None
    for old, new in zip(before, after):
        diff = (old != new).reshape(2, -1, old.shape[-2] * old.shape[-1]).any(dim=-1).any(dim=0)
        changed = diff if changed is None else changed | diff
    return set(torch.nonzero(changed).flatten().tolist())
