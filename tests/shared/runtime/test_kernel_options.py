"""KernelOptions: each engine's own, installed around its set-up and its steps, read by the
kernel launchers; nothing process-wide. The oracle is a spy on a launcher's dispatch rule
that records the options it sees, and the JSON the config and CLI accept."""

from __future__ import annotations

import pydantic
import pytest

from policy import EngineArgs
from policy.kernel_options import KernelOptions
from shared import LLM, SamplingParams
from shared.model.kernels import fused_ops
from shared.runtime.kernel_options import DEFAULT_KERNEL_OPTIONS, kernel_options, use_kernel_options


def test_defaults_are_the_shipped_configuration_and_frozen():
    options = KernelOptions()
    assert options == DEFAULT_KERNEL_OPTIONS == kernel_options()
    assert (options.pdl, options.gemv, options.fused_ops, options.gemv_max_tokens) == (True, True, True, 1)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        options.pdl = False  # frozen: a captured graph's options cannot change under it
    with pytest.raises(ValueError):
        KernelOptions(fused_decode_kv_write="sometimes")


def test_scope_nests_and_restores():
    with use_kernel_options(KernelOptions(pdl=False)):
        assert not kernel_options().pdl
        with use_kernel_options(KernelOptions(gemv_max_tokens=4)):
            assert kernel_options().pdl and kernel_options().gemv_max_tokens == 4
        assert not kernel_options().pdl
    assert kernel_options() == DEFAULT_KERNEL_OPTIONS


def test_engine_args_and_cli_json_reach_the_config():
    cfg = EngineArgs(model="tiny-llama", device="cpu",
                     kernel_options={"pdl": False, "gemv_configs": {"k": [8, 64, 4, 1, 2]}}
                     ).create_engine_config()
    assert cfg.kernel_options.pdl is False
    assert cfg.kernel_options.gemv_config("k") == (8, 64, 4, 1, 2)
    import argparse

    from policy.engine_args import add_engine_args, engine_args_from_namespace

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", "tiny-llama", "--kernel-options", '{"nvtx": true}'])
    assert engine_args_from_namespace(ns).kernel_options.nvtx is True


def test_nvtx_env_sets_the_option(monkeypatch):
    monkeypatch.setenv("RUNNERLAB_NVTX", "1")
    assert EngineArgs(model="tiny-llama", device="cpu").create_engine_config().kernel_options.nvtx
    monkeypatch.setenv("RUNNERLAB_NVTX", "maybe")
    with pytest.raises(ValueError, match="RUNNERLAB_NVTX"):
        EngineArgs(model="tiny-llama", device="cpu").create_engine_config()


def test_two_engines_in_one_process_each_launch_with_their_own(monkeypatch):
    """Interleaved steps of two engines: the dispatch rule the model's layers call sees
    the options of the engine that is stepping, never the other's or the defaults."""
    seen: list[tuple[str, int]] = []
    real = fused_ops.use_fused

    def spy(x):
        seen.append(kernel_options().gemv_max_tokens)
        return real(x)

    monkeypatch.setattr(fused_ops, "use_fused", spy)
    a = LLM(model="tiny-llama", device="cpu", model_runner="v1",
            kernel_options=KernelOptions(gemv_max_tokens=3))
    b = LLM(model="tiny-llama", device="cpu", model_runner="v1",
            kernel_options=KernelOptions(gemv_max_tokens=7))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for llm, tag in ((a, "a"), (b, "b")):
        llm.engine.add_request(tag, [1, 2, 3], params)
    for _ in range(3):
        for llm, want in ((a, 3), (b, 7)):
            seen.clear()
            llm.engine.step()
            assert seen and set(seen) == {want}
    assert kernel_options() == DEFAULT_KERNEL_OPTIONS  # nothing leaked out of the steps


def test_null_attention_backend_launches_no_attention(monkeypatch):
    """NULL (benchmarks only): a step runs, and neither the KV write nor any backend's
    attention is called."""
    import shared.attention.layer as layer

    calls = []
    monkeypatch.setattr(layer, "write_kv", lambda *a: calls.append("write_kv"))
    llm = LLM(model="tiny-llama", device="cpu", model_runner="v1", attention_backend="NULL")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and calls == []


@pytest.mark.parametrize("changes,field", [
    ({"invariant_split_tokens": 96}, "invariant_split_tokens"),
    ({"attention_split_tokens": 200}, "attention_split_tokens"),
    ({"attention_split_tokens": 192, "attention_tile_n": 128}, "attention_split_tokens"),
])
def test_a_split_that_is_not_whole_tiles_is_refused_at_config_time(changes, field):
    with pytest.raises(ValueError, match=f"KernelOptions.{field}="):
        KernelOptions(**changes)


def test_splits_of_whole_tiles_are_accepted():
    options = KernelOptions(invariant_split_tokens=128, attention_split_tokens=256,
                            attention_tile_n=128)
    assert (options.invariant_split_tokens, options.attention_split_tokens) == (128, 256)
