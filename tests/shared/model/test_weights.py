"""Weight loading: clear errors, no pickles, and a dummy init that is seeded and sane."""

from __future__ import annotations

import pathlib
import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from shared.model import SUPPORTED_ARCHITECTURES, get_model_class, load_model
from shared.model.loader import initialize_dummy_weights
from tests.oracles.paged_attention import PagedHarness
from tests.shared.model.test_model_hf import CONFIGS, make_hf_model

MODEL_SRC = pathlib.Path(__file__).resolve().parents[3] / "shared" / "model"


@pytest.fixture
def saved_llama(tmp_path):
    make_hf_model("llama").save_pretrained(tmp_path)
    return tmp_path


def _rewrite_checkpoint(model_dir, edit) -> None:
    (path,) = model_dir.glob("*.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _load(model_dir, **kw):
    config = AutoConfig.from_pretrained(model_dir)
    return load_model(config, model_dir=str(model_dir), dtype=torch.float32, device="cpu", **kw)


def test_missing_safetensors_names_the_directory(tmp_path):
    CONFIGS["llama"]().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        _load(tmp_path)


def test_pickled_checkpoint_is_refused_not_unpickled(tmp_path, monkeypatch):
    CONFIGS["llama"]().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even a pickle")

    def forbidden(*args, **kwargs):
        raise AssertionError("a pickle loader was called")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    with pytest.raises(FileNotFoundError, match="refuses to unpickle"):
        _load(tmp_path)


def test_no_pickle_loading_in_the_model_package():
    banned = re.compile(r"torch\.load\(|import pickle|pickle\.load|trust_remote_code\s*=\s*True")
    for path in MODEL_SRC.glob("*.py"):
        assert not banned.search(path.read_text()), f"{path.name} loads pickles or remote code"


def test_unknown_tensor_name_is_named(saved_llama):
    bogus = "model.layers.0.mlp.bogus_proj.weight"
    _rewrite_checkpoint(saved_llama, lambda t: t.__setitem__(bogus, torch.zeros(3)))
    with pytest.raises(KeyError, match=re.escape(bogus)):
        _load(saved_llama)


def test_shape_mismatch_is_named(saved_llama):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_checkpoint(saved_llama, lambda t: t.__setitem__(name, torch.zeros(5, 64)))
    with pytest.raises(ValueError, match=re.escape(name)):
        _load(saved_llama)


def test_missing_tensor_leaves_an_error(saved_llama):
    _rewrite_checkpoint(saved_llama, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        _load(saved_llama)


def test_auto_without_weights_points_to_dummy():
    with pytest.raises(ValueError, match="load_format='dummy'"):
        load_model(CONFIGS["llama"](), dtype=torch.float32, device="cpu")


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="Qwen2MoeForCausalLM") as err:
        get_model_class("GPT2LMHeadModel")
    assert "GPT2LMHeadModel" in str(err.value)
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"} <= SUPPORTED_ARCHITECTURES


def _dummy(name, seed, dtype=torch.float32, **overrides):
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return load_model(config, load_format="dummy", dtype=dtype, device="cpu", seed=seed)


def test_dummy_init_is_seeded():
    a, b, c = _dummy("qwen2-moe", 0), _dummy("qwen2-moe", 0), _dummy("qwen2-moe", 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["model.layers.0.self_attn.qkv_proj.weight"],
        sc["model.layers.0.self_attn.qkv_proj.weight"],
    )
    assert torch.equal(sa["model.layers.0.input_layernorm.weight"], torch.ones(64))
    w = sa["model.layers.0.mlp.experts.gate_up_proj"]  # [E, 2I, H]: std 1/sqrt(H)
    assert abs(w.std().item() - 64**-0.5) < 0.01 and abs(w.mean().item()) < 0.01
    # the same seed gives the same model in float64 (values drawn in float32, then cast)
    d = _dummy("qwen2-moe", 0, torch.float64).state_dict()
    assert all(torch.equal(sa[k].double(), d[k]) for k in sa)


def test_dummy_init_fills_every_parameter():
    model = get_model_class("MixtralForCausalLM")(CONFIGS["mixtral"]())
    for p in model.parameters():
        p.data.fill_(float("nan"))
    initialize_dummy_weights(model, seed=3)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["llama", "qwen3-tied", "qwen2-moe"])
def test_dummy_model_is_finite_and_varied_over_many_layers(name):
    model = _dummy(name, 0, num_hidden_layers=32)
    harness = PagedHarness(model, num_blocks=16, block_size=4)
    blocks = list(range(16))
    prompt = list(range(10, 50, 3))
    logits = harness.step([(prompt, 0, blocks)])
    assert torch.isfinite(logits).all()
    assert len(set(logits.argmax(-1).tolist())) >= len(prompt) // 2
    tokens = [int(logits[-1].argmax())]
    for i in range(11):
        logits = harness.step([([tokens[-1]], len(prompt) + i, blocks)])
        assert torch.isfinite(logits).all()
        tokens.append(int(logits[-1].argmax()))
    assert len(set(tokens)) >= 6, f"greedy tokens of a random model collapsed: {tokens}"


def test_rope_cache_keeps_its_precision_across_dtype_moves():
    model = _dummy("llama", 0)
    assert model.rope.cos_sin_cache.dtype == torch.float32
    model.to(torch.bfloat16)
    assert model.rope.cos_sin_cache.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16
    model.to(torch.float64)
    cache = model.rope.cos_sin_cache
    assert cache.dtype == torch.float64
    # rebuilt from the frequencies, not upcast from float32: cos^2 + sin^2 == 1 to fp64
    cos, sin = cache.chunk(2, dim=-1)
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos), rtol=0, atol=1e-15)
