"""V2 on the GPU: one launch per staged apply, no host sync in execute_model on the
decode path nor on a step that admits requests, and the UVA-backed token table (GPU
machine only)."""

from __future__ import annotations

import pytest
import torch

from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine

pytestmark = pytest.mark.gpu


def _v2_engine(**kw) -> LLMEngine:
    from policy import EngineArgs

    args = dict(
        model="qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda", seed=0,
        model_runner="v2", max_model_len=512, max_num_seqs=32, max_num_batched_tokens=1024,
        num_gpu_blocks_override=2048,
    )
    args.update(kw)
    return LLMEngine.from_engine_args(EngineArgs(**args))


def test_one_launch_per_apply_write() -> None:
    from runner_v2.staged_write import StagedWriteTensor

    t = StagedWriteTensor((64, 256), torch.int32, torch.device("cuda"))
    for row in range(64):
        t.stage_write(row, row % 7, list(range(row % 50 + 1)))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t.apply_write()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    assert len(kernels) == 1, [e.name for e in kernels]
    expected = torch.zeros(64, 256, dtype=torch.int32)
    for row in range(64):
        n = row % 50 + 1
        expected[row, row % 7 : row % 7 + n] = torch.arange(n, dtype=torch.int32)
    assert torch.equal(t.gpu.cpu(), expected)


def _step_without_sync(engine: LLMEngine, so) -> None:
    """The runner's execute_model for `so` with any synchronising CUDA call an error;
    then its sampling and the scheduler's update, as the engine would."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.runner.execute_model(so)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = engine.runner.sample_tokens(None).get_output()
    engine.scheduler.update_from_output(so, out)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_host_sync_in_execute_model_on_decode(enforce_eager: bool) -> None:
    engine = _v2_engine(enforce_eager=enforce_eager)
    params = SamplingParams(max_tokens=50, temperature=0.8, top_p=0.9, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", [i + 1] * (4 + i), params)
    for _ in range(4):
        engine.step()  # prefill, then steady decode
    for _ in range(3):
        so = engine.scheduler.schedule()
        assert so.total_num_scheduled_tokens == so.num_reqs  # pure decode
        _step_without_sync(engine, so)


def test_no_host_sync_in_execute_model_when_requests_arrive() -> None:
    """A step that admits requests (the sampling states' records, penalty bins, logit
    bias and bad words staged and shipped) beside decoding ones: no synchronising call."""
    engine = _v2_engine()
    plain = SamplingParams(max_tokens=50, temperature=0.8, top_p=0.9, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [i + 1] * (4 + i), plain)
    for _ in range(3):
        engine.step()
    arrivals = [
        SamplingParams(max_tokens=8, temperature=0.7, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, logit_bias={5: 2.0, 9: -1.0},
                       ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.5, bad_words_token_ids=[[3, 4], [7]],
                       frequency_penalty=0.3, ignore_eos=True),
    ]
    for step, params in enumerate(arrivals):
        engine.add_request(f"new{step}", [11, 12, 13 + step], params)
        so = engine.scheduler.schedule()
        assert so.scheduled_new_reqs, "the step admits the new request"
        _step_without_sync(engine, so)


def test_uva_token_table_is_host_memory_read_by_kernels() -> None:
    engine = _v2_engine()
    table = engine.runner.req_states.all_token_ids
    assert table.uses_uva and table.gpu.is_cuda
    # zero-copy: the device tensor's address is the pinned host buffer's address
    assert table.gpu.data_ptr() == table._host_base.data_ptr()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(1, 40)), params)  # prefill read through UVA
    row = engine.runner.req_states.free_indices[-1]  # LIFO: the row "a" will take
    outputs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out.outputs[0].token_ids
    torch.cuda.synchronize()
    # the prompt landed in host memory, and post_update appended the sampled tokens
    # there through the same zero-copy view (the last one is never needed as input)
    row_tokens = table._host_base[row].tolist()
    assert row_tokens[:39] == list(range(1, 40))
    assert row_tokens[39:43] == outputs[:4]


def _seeded_tokens(repeat_launches: bool) -> list[list[int]]:
    engine = _v2_engine(dtype="float32", kernel_options={"repeat_launches": repeat_launches})
    for i in range(6):
        engine.add_request(str(i), [(i * 13 + j) % 900 + 1 for j in range(5 + 3 * i)],
                           SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i,
                                          ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[str(i)] for i in range(6)]


def test_kept_launches_give_the_dispatchs_tokens_and_skip_it(monkeypatch) -> None:
    """The per-step kernels (input prep, sampler, post-update) through their kept compiled
    kernels sample exactly what Triton's dispatch gives; and the kept path is taken: the
    sampler's kernel goes through the JIT far less often than it launches."""
    from runner_v2.sample import gumbel

    kernel = gumbel._gumbel_sample_kernel
    jit_calls, run = [], kernel.run

    def counted(*args, **kwargs):
        jit_calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted)
    dispatched = _seeded_tokens(repeat_launches=False)
    dispatch_calls = len(jit_calls)
    jit_calls.clear()
    assert _seeded_tokens(repeat_launches=True) == dispatched
    assert dispatch_calls >= 12 and len(jit_calls) < dispatch_calls / 2, (
        len(jit_calls), dispatch_calls)
