"""The draft model's CUDA graphs on CPU, both runners: an engine with the target's and the
draft's graphs as a CUDA machine configures them, recorded with the eager stand-ins
(tests/shared/runtime/eager_graphs.py), against the same engine without graphs. A stand-in
replays the captured closure over the persistent buffers, so an input the FULL graph does
not read from them (a stale row, a missing copy, a wrong pad) changes the tokens or the
draft's KV here too.
"""

from __future__ import annotations

import torch

from policy import EngineArgs
from policy import config as config_module
from runner_v1.spec_decode.draft_inputs import v1_full_query_lens
from runner_v2.spec_decode.draft_proposer import v2_full_query_lens
from shared.contract.sampling_params import SamplingParams
from shared.runtime import draft_graphs
from shared.runtime.draft_executor import DraftForward
from shared.runtime.draft_graphs import draft_graph_config
from shared.serving.engine import LLMEngine
from tests.policy.test_features import _install_graphs
from tests.shared.runtime.eager_graphs import use_eager_graphs

# float64: eager and graph runs pad their batches differently (other matmul shapes), and
# the oracle is equality; TRITON (interpreted) is the backend that runs inside FULL graphs
RUN = dict(model="tiny-llama", dtype="float64", attention_backend="TRITON", seed=0,
           max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
           num_gpu_blocks_override=48, enable_prefix_caching=False)
# three requests of different lengths and lives: a prefill step (non-uniform catch-up),
# three decoding together (padded to the graphs of 4), then two, then one (stale rows)
REQUESTS = [([5, 6, 7], 9), ([8, 9, 10, 11, 12], 5), ([13, 14], 12)]
# the CUDA machine's graph sizes: 2 and 3 requests replay the graphs of 4 (padded rows)
CAPTURE_SIZES = [1, 4]


def draft_forward_of(engine: LLMEngine) -> DraftForward:
    spec = engine.runner.speculator
    return spec.draft.draft_forward if engine.runner_name == "v1" else spec.proposer.draft_forward


def _set_draft_forward(engine: LLMEngine, forward: DraftForward) -> None:
    spec = engine.runner.speculator
    if engine.runner_name == "v1":
        spec.draft.draft_forward = forward
    else:
        spec.proposer.draft_forward = forward


def engine_for(runner: str, spec: dict, **kw) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(device="cpu", model_runner=runner,
                                                 speculative_config=spec, **RUN, **kw))


def with_cuda_graphs(runner: str, spec: dict, monkeypatch, kernel_options: dict | None = None,
                     **kw) -> LLMEngine:
    """A CPU engine with the graphs a CUDA machine captures for this configuration
    (FULL_AND_PIECEWISE), the target's and the draft's, recorded eagerly."""
    options = {"kernel_options": kernel_options} if kernel_options else {}
    with monkeypatch.context() as m:  # the configuration a CUDA machine gets
        m.setattr(config_module, "cuda_available", lambda: True)
        cuda_config = EngineArgs(device="cuda", model_runner=runner, speculative_config=spec,
                                 cudagraph_mode="FULL_AND_PIECEWISE",
                                 cudagraph_capture_sizes=CAPTURE_SIZES, **RUN, **options,
                                 **kw).create_engine_config()
    engine = engine_for(runner, spec, **options, **kw)
    old = draft_forward_of(engine)
    k = spec["num_speculative_tokens"]
    lens = v1_full_query_lens(k) if runner == "v1" else v2_full_query_lens(k)
    graphs = draft_graph_config(cuda_config, True, old.executor.backend, lens, old.max_num_tokens)
    _set_draft_forward(engine, DraftForward(old.executor, old.max_num_tokens, graphs, old.device))
    use_eager_graphs(monkeypatch, _install_graphs(engine, cuda_config), draft_graphs)
    engine.runner.capture_model()
    return engine


def generate(engine: LLMEngine) -> tuple[dict[str, list[int]], list[torch.Tensor]]:
    """Greedy -> (tokens per request, the draft's KV caches after the run)."""
    for i, (prompt, max_tokens) in enumerate(REQUESTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens,
                                                           temperature=0.0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    executor = draft_forward_of(engine).executor
    return tokens, [kv.clone() for kv in executor.kv_caches]


def record_full_replays(monkeypatch) -> list[tuple[int, int]]:
    """(query length, padded request count) of every FULL draft replay, in order."""
    seen: list[tuple[int, int]] = []
    real = draft_graphs.DraftFullGraphs.replay

    def replay(self, desc):
        seen.append((desc.uniform_query_len, desc.num_reqs))
        return real(self, desc)

    monkeypatch.setattr(draft_graphs.DraftFullGraphs, "replay", replay)
    return seen


def check_full_draft_graphs(runner: str, spec: dict, monkeypatch) -> list[tuple[int, int]]:
    """The tokens and the draft's KV of the engine without graphs; the mode counters
    match the FULL replays seen. -> (query length, padded request count) of each replay."""
    tokens, kv = generate(engine_for(runner, spec))
    replays = record_full_replays(monkeypatch)
    engine = with_cuda_graphs(runner, spec, monkeypatch)
    got_tokens, got_kv = generate(engine)
    assert got_tokens == tokens
    for want, got in zip(kv, got_kv):  # padded rows wrote nothing, real ones the same
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    counts = draft_forward_of(engine).counts
    assert counts["full"] == len(replays) > 0, counts
    return replays
