"""Every bad field fails with a message naming the field (and, for our own checks, the bad
value and the accepted values); every default resolves as documented."""

import dataclasses

import pytest
from pydantic import ValidationError

from policy import EngineArgs
from policy.config import default_capture_sizes


def _create(**kwargs):
    kwargs.setdefault("model", "tiny-llama")
    kwargs.setdefault("device", "cpu")
    return EngineArgs(**kwargs).create_engine_config()


# (kwargs, texts the message must contain)
BAD = [
    ({"block_size": 12}, ["block_size=12", "power of two"]),
    ({"block_size": 0}, ["block_size=0", "accepted"]),
    ({"block_size": 2048}, ["block_size=2048", "1 to 1024"]),
    ({"max_num_seqs": 0}, ["max_num_seqs=0", "accepted"]),
    ({"max_num_seqs": -3}, ["max_num_seqs=-3"]),
    ({"max_num_seqs": 16, "max_num_batched_tokens": 8}, ["max_num_batched_tokens=8", "max_num_seqs=16"]),
    ({"max_num_batched_tokens": -1}, ["max_num_batched_tokens=-1"]),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 256},
     ["max_num_batched_tokens=256", "max_model_len=512", "enable_chunked_prefill=False"]),
    ({"num_gpu_blocks_override": 0}, ["num_gpu_blocks_override=0", "None or an integer >= 1"]),
    ({"gpu_memory_utilization": 0.0}, ["gpu_memory_utilization=0.0", "(0, 1]"]),
    ({"gpu_memory_utilization": 1.5}, ["gpu_memory_utilization=1.5"]),
    ({"max_model_len": 1024}, ["max_model_len=1024", "max_position_embeddings=512", "1..512"]),
    ({"max_model_len": 0}, ["max_model_len=0"]),
    ({"seed": -1}, ["seed=-1", "accepted"]),
    ({"tensor_parallel_size": 0}, ["tensor_parallel_size=0", "accepted: an integer >= 1"]),
    ({"pipeline_parallel_size": -2}, ["pipeline_parallel_size=-2"]),
    ({"tensor_parallel_size": 3}, ["tensor_parallel_size=3", "num_attention_heads (4)"]),
    ({"tensor_parallel_size": 2, "distributed_timeout_s": 0}, ["distributed_timeout_s=0"]),
    ({"pipeline_parallel_size": 4}, ["pipeline parallelism > 1", "pipeline_parallel_size=1"]),
    ({"model": "no-such-model"}, ["model='no-such-model'", "tiny-llama", "llama-3-8b"]),
    ({"model": "llama-3-8b"}, ["load_format='auto'", 'load_format="dummy"', "llama-3-8b"]),
    ({"model": "qwen3-0.6b", "load_format": "auto"}, ['load_format="dummy"']),
    ({"device": "cuda"}, ["device='cuda'", "no CUDA GPU", "'cpu'"]),
    ({"cudagraph_mode": "FULL"}, ["cudagraph_mode='FULL'", "device='cuda'", "'NONE'"]),
    ({"cudagraph_capture_sizes": [1, 2]}, ["cudagraph_capture_sizes=[1, 2]", "ignored"]),
    ({"attention_backend": "FLASH_ATTN"}, ["attention_backend='FLASH_ATTN'", "'TORCH'"]),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}, "model_runner": "v2"},
     ["ngram speculative decoding", "model_runner='v1'", "speculative_config=None"]),
    ({"speculative_config": {"method": "draft_model", "model": "tiny-llama-draft",
                             "num_speculative_tokens": 2, "rejection_sample_method": "block"},
      "model_runner": "v1"},
     ["rejection_sample_method='block'", "model_runner='v2'", "rejection_sample_method='standard'"]),
    ({"logits_processors": ["pkg.mod:Proc"]}, ["logits_processors entry 'pkg.mod:Proc'",
                                                "cannot import module 'pkg.mod'"]),
    ({"pooling_task": "classify"}, ["pooling_task='classify'", "LlamaForCausalLM",
                                    "*ForSequenceClassification"]),
    ({"pooling_task": "token_embed", "model_runner": "v2"},
     ["pooling task token_embed", "model_runner='v1'", "pooling_task=None"]),
    ({"pooler_config": {"normalize": False}}, ["pooler_config=", "pooling_task=None"]),
    ({"enable_prompt_embeds": True}, ["prompt embeds", "enable_prompt_embeds=False"]),
]


@pytest.mark.parametrize("kwargs, texts", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_field_is_named(kwargs, texts):
    with pytest.raises(ValueError) as err:
        _create(**kwargs)
    for text in texts:
        assert text in str(err.value), str(err.value)


# pydantic rejects wrong types and unknown literals when EngineArgs is built: the message
# names the field, the input and the accepted values.
TYPE_ERRORS = [
    ({"dtype": "fp8"}, ["dtype", "fp8", "'float32'", "'bfloat16'"]),
    ({"device": "tpu"}, ["device", "tpu", "'cpu'", "'cuda'"]),
    ({"load_format": "pt"}, ["load_format", "'dummy'"]),
    ({"model_runner": "v3"}, ["model_runner", "'v1'", "'v2'"]),
    ({"cudagraph_mode": "full"}, ["cudagraph_mode", "'FULL_AND_PIECEWISE'"]),
    ({"attention_backend": "SDPA"}, ["attention_backend", "'TRITON'"]),
    ({"block_size": 3.5}, ["block_size", "3.5"]),
    ({"speculative_config": {"method": "eagle", "num_speculative_tokens": 2}},
     ["speculative_config.method", "eagle", "'ngram'", "'draft_model'"]),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                             "rejection_sample_method": "strict"}},
     ["rejection_sample_method", "strict", "'standard'", "'synthetic'", "'block'"]),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "typo_field": 1}},
     ["typo_field"]),
    ({"no_such_field": 1}, ["no_such_field"]),
]


@pytest.mark.parametrize("kwargs, texts", TYPE_ERRORS, ids=[str(t[0]) for t in TYPE_ERRORS])
def test_type_errors_are_validation_errors(kwargs, texts):
    with pytest.raises(ValidationError) as err:
        EngineArgs(model="tiny-llama", **kwargs)
    assert isinstance(err.value, ValueError)
    for text in texts:
        assert text in str(err.value)


def test_bad_attention_env_is_named(monkeypatch):
    monkeypatch.setenv("RUNNERLAB_ATTENTION_BACKEND", "flashinfer")
    with pytest.raises(ValueError, match="RUNNERLAB_ATTENTION_BACKEND='flashinfer'"):
        _create()
    monkeypatch.setenv("RUNNERLAB_ATTENTION_BACKEND", "FLASH_ATTN")
    with pytest.raises(ValueError, match="RUNNERLAB_ATTENTION_BACKEND='FLASH_ATTN'.*cpu"):
        _create()


def test_cpu_defaults():
    cfg = _create(dtype="auto")
    assert cfg.device == "cpu" and cfg.model_config.dtype == "float32"
    s = cfg.scheduler_config
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len) == (32, 2048, 512)
    assert s.enable_chunked_prefill and cfg.cache_config.enable_prefix_caching
    assert cfg.cache_config.block_size == 16 and cfg.cache_config.gpu_memory_utilization == 0.9
    c = cfg.compilation_config
    assert (c.cudagraph_mode, c.cudagraph_capture_sizes) == ("NONE", [])
    assert (cfg.attention_backend, cfg.attention_backend_source) == ("TORCH", "auto")
    assert (cfg.load_config.load_format, cfg.load_config.weight_source) == ("auto", "random")
    assert cfg.parallel_config.tensor_parallel_size == 1


def _ladder(max_size):
    """Independent spelling of the documented ladder."""
    sizes, s = [], 1
    while s <= max_size:
        sizes.append(s)
        s = s * 2 if s < 8 else (s + 8 if s < 256 else s + 16)
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


@pytest.mark.parametrize("max_size", [1, 3, 8, 100, 256, 300, 512, 1024])
def test_default_capture_ladder(max_size):
    assert default_capture_sizes(max_size) == _ladder(max_size)


def test_cuda_defaults(fake_cuda):
    cfg = _create(device="auto")
    assert cfg.device == "cuda" and cfg.model_config.dtype == "bfloat16"
    s = cfg.scheduler_config
    assert (s.max_num_seqs, s.max_num_batched_tokens) == (256, 8192)
    c = cfg.compilation_config
    assert cfg.runner_decision.runner == "v2" and c.cudagraph_mode == "FULL_AND_PIECEWISE"
    # piecewise graphs reach twice the decode batch's tokens, capped at 512 (vLLM's rule)
    assert c.cudagraph_capture_sizes == _ladder(512) and c.max_capture_size == 512
    assert (cfg.attention_backend, cfg.attention_backend_source) == ("TRITON", "auto")


@pytest.mark.parametrize("kwargs,largest", [
    ({"max_num_seqs": 8}, 16),  # 8 requests x 1 token x 2
    ({"max_num_seqs": 8, "cudagraph_mode": "FULL"}, 8),  # FULL graphs: uniform decode only
    ({"max_num_seqs": 8, "cudagraph_mode": "PIECEWISE"}, 16),
    ({"max_num_seqs": 100, "max_num_batched_tokens": 128}, 128),  # the token budget bounds
    ({"max_num_seqs": 1024, "max_num_batched_tokens": 8192}, 1024),  # never below max_num_seqs
    ({"max_num_seqs": 4, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
     32),  # 4 requests x (1 + 3) tokens x 2
    ({"max_num_seqs": 300, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
     512),
])
def test_default_largest_capture_size(fake_cuda, kwargs, largest):
    c = _create(device="cuda", model_runner="v1", **kwargs).compilation_config
    assert c.max_capture_size == largest
    assert kwargs["max_num_seqs"] in c.cudagraph_capture_sizes or largest < kwargs["max_num_seqs"]


def test_cuda_auto_mode_for_v1_too_and_eager(fake_cuda):
    assert _create(model="tiny-mixtral", device="cuda").compilation_config.cudagraph_mode == (
        "FULL_AND_PIECEWISE")
    eager = _create(device="cuda", enforce_eager=True).compilation_config
    assert (eager.cudagraph_mode, eager.cudagraph_capture_sizes) == ("NONE", [])
    with pytest.raises(ValueError, match="cudagraph_mode='FULL'.*enforce_eager=True"):
        _create(device="cuda", enforce_eager=True, cudagraph_mode="FULL")


def test_capture_sizes_bounded(fake_cuda):
    cfg = _create(device="cuda", max_num_seqs=100, max_model_len=256)
    # up to 2 x 100 tokens for the mixed batches, with 100 itself for the FULL decode graphs
    assert cfg.compilation_config.cudagraph_capture_sizes == sorted(_ladder(200) + [100])
    sizes = cfg.compilation_config.cudagraph_capture_sizes
    assert sizes[sizes.index(100) - 2:sizes.index(100) + 2] == [88, 96, 100, 104]
    assert cfg.compilation_config.cudagraph_capture_sizes[-3:] == [184, 192, 200]
    explicit = _create(device="cuda", cudagraph_capture_sizes=[4, 1, 2, 2])
    assert explicit.compilation_config.cudagraph_capture_sizes == [1, 2, 4]
    # FULL graphs are uniform decodes: sizes up to max_num_seqs ...
    with pytest.raises(ValueError, match=r"cudagraph_capture_sizes=\[1, 64\].*max_num_seqs=32"):
        _create(device="cuda", max_num_seqs=32, cudagraph_mode="FULL",
                cudagraph_capture_sizes=[1, 64])
    # ... piecewise graphs ("auto": FULL_AND_PIECEWISE) take any batch up to the token budget
    both = _create(device="cuda", max_num_seqs=32, cudagraph_capture_sizes=[1, 64])
    assert both.compilation_config.cudagraph_capture_sizes == [1, 64]
    with pytest.raises(ValueError, match=r"\[1, 256\].*max_num_batched_tokens=128"):
        _create(device="cuda", max_num_seqs=32, max_num_batched_tokens=128,
                cudagraph_capture_sizes=[1, 256])
    with pytest.raises(ValueError, match="cudagraph_capture_sizes=\\[\\]"):
        _create(device="cuda", cudagraph_capture_sizes=[])


def test_batched_tokens_default_follows_seqs_and_len():
    assert _create(max_num_seqs=4096).scheduler_config.max_num_batched_tokens == 4096
    cfg = _create(model="llama-3-8b", load_format="dummy", enable_chunked_prefill=False)
    assert cfg.scheduler_config.max_num_batched_tokens == 4096 == cfg.scheduler_config.max_model_len


@pytest.mark.parametrize("model, device, expected", [
    ("tiny-llama", "cpu", "float32"),
    ("smollm2-135m", "cpu", "float32"),
    ("tiny-llama", "cuda", "bfloat16"),     # float32 checkpoint -> bf16 on a GPU
    ("smollm2-135m", "cuda", "bfloat16"),
])
def test_auto_dtype(fake_cuda, model, device, expected):
    cfg = EngineArgs(model=model, device=device, load_format="dummy").create_engine_config()
    assert cfg.model_config.dtype == expected


def test_explicit_dtype_kept():
    assert _create(dtype="float64").model_config.dtype == "float64"
    assert _create(dtype="float16").model_config.torch_dtype.itemsize == 2


def test_max_model_len_defaults():
    assert _create(model="llama-3-8b", load_format="dummy").model_config.max_model_len == 4096
    assert _create(model="qwen3-0.6b", load_format="dummy").scheduler_config.max_model_len == 4096
    assert _create(max_model_len=100).scheduler_config.max_model_len == 100


def test_attention_backend_resolution(monkeypatch):
    monkeypatch.setenv("RUNNERLAB_ATTENTION_BACKEND", "TRITON")
    cfg = _create()
    assert (cfg.attention_backend, cfg.attention_backend_source) == ("TRITON", "env")
    cfg = _create(attention_backend="TORCH")  # an explicit argument beats the env var
    assert (cfg.attention_backend, cfg.attention_backend_source) == ("TORCH", "argument")


def test_engine_config_is_frozen_and_serialisable():
    cfg = _create()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.scheduler_config.max_num_seqs = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model_config = None
    dumped = cfg.model_dump()
    assert "hf_config" not in dumped["model_config"]
    assert dumped["runner_decision"]["runner"] == "v2"
