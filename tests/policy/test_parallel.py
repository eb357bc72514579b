"""policy/parallel.py: which tensor-parallel sizes a model can be split into, and the
launch checks, against hand-written expectations."""

from types import SimpleNamespace

import pytest

from policy.parallel import check_launch, check_model_split, resolve_parallel, torchrun_world


def _model(heads=32, kv=8, inter=14336, **hf):
    return SimpleNamespace(num_attention_heads=heads, num_kv_heads=kv, intermediate_size=inter,
                           hf_config=SimpleNamespace(**hf))


@pytest.mark.parametrize("tp, kwargs", [
    (1, {"heads": 7, "kv": 7, "inter": 11}),      # one rank splits nothing
    (2, {}), (4, {}), (8, {}),                      # Llama-3-8B: 32 heads, 8 KV heads
    (16, {}), (32, {}),                             # KV heads replicated on 2 and 4 ranks
    (2, {"heads": 16, "kv": 8, "inter": 3072}),     # qwen3-0.6b
    (4, {"heads": 4, "kv": 2, "inter": 128}),       # tiny-llama: each KV head on 2 ranks
    (2, {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 128}),
])
def test_sizes_that_split(tp, kwargs):
    check_model_split(tp, _model(**kwargs))


@pytest.mark.parametrize("tp, kwargs, field", [
    (3, {}, "num_attention_heads (32)"),
    (64, {}, "num_attention_heads (32)"),
    (2, {"heads": 12, "kv": 3, "inter": 128}, "num_key_value_heads=3"),
    (4, {"heads": 12, "kv": 6, "inter": 128}, "num_key_value_heads=6"),  # 6 % 4, 4 % 6
    (4, {"heads": 8, "kv": 8, "inter": 102}, "intermediate_size (102)"),
    (2, {"moe_intermediate_size": 63}, "moe_intermediate_size (63)"),
])
def test_sizes_that_do_not(tp, kwargs, field):
    with pytest.raises(ValueError) as err:
        check_model_split(tp, _model(**kwargs))
    assert f"tensor_parallel_size={tp}" in str(err.value) and field in str(err.value)


def test_the_vocabulary_never_refuses():
    # the vocabulary is padded per rank, not refused: a prime vocabulary splits 2 ways
    check_model_split(2, _model(vocab_size=50257))


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_more_ranks_than_gpus(no_torchrun):
    no_torchrun.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs .* 1 are "
                                         r"visible \(CUDA_VISIBLE_DEVICES=0\)"):
        check_launch(2, "cuda", visible_devices=1)
    check_launch(2, "cuda", visible_devices=2)
    check_launch(2, "cpu", visible_devices=0)  # gloo ranks need no GPU


def test_torchrun_world_must_be_the_group(no_torchrun):
    assert torchrun_world() is None
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        no_torchrun.setenv(name, value)
    assert torchrun_world() == (1, 4, 2)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 .* --nproc-per-node 2"):
        check_launch(2, "cpu", visible_devices=None)
    # two nodes of two: each host needs only its local ranks' GPUs
    check_launch(4, "cuda", visible_devices=2)
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        check_launch(4, "cuda", visible_devices=1)


def test_resolve_parallel_carries_the_timeout():
    cfg = resolve_parallel(2, 1, model=_model(), distributed_timeout_s=7.5)
    assert (cfg.tensor_parallel_size, cfg.distributed_timeout_s, cfg.distributed) == (2, 7.5, True)
    with pytest.raises(ValueError, match="pipeline_parallel_size=0"):
        resolve_parallel(1, 0)
