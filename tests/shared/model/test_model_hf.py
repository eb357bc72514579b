"""Our five architectures vs Hugging Face transformers on tiny random models.

Each model is saved with `save_pretrained` (safetensors), loaded with our loader, and run
as a ragged batch through the paged KV cache with the TORCH backend
(tests/oracles/paged_attention.PagedHarness):
  step 1: prefill request A fully + the first chunk of request B,
  step 2: decode A (one token) + the rest of B's prompt (a chunk after a cached prefix),
with non-contiguous block ids. Every position's logits must match transformers' forward
over the full sequences (in float64 with the patches of tests/oracles/hf_float64.py):
float64 to 1e-10, float32 to 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
)

from shared.model import load_model
from tests.oracles.hf_float64 import hf_logits, hf_oracle
from tests.oracles.paged_attention import PagedHarness

# ---------------------------------------------------------------------------------------
# tiny configs

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, rope_theta=10000.0),
    "llama3-rope": lambda: LlamaConfig(
        **COMMON,
        rope_scaling={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3-tied": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2-moe": lambda: Qwen2MoeConfig(
        **{**COMMON, "num_hidden_layers": 3},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],  # layer 1 is dense: the loader must honour it
    ),
}


def make_hf_model(name: str, seed: int = 0):
    """A transformers model with every parameter randomised (norm weights around 1,
    nonzero biases), so that no weight the loader might drop is a no-op."""
    torch.manual_seed(seed)
    cfg = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # float64 fails on grouped_mm
    return randomise_parameters(model).eval()


@torch.no_grad()
def randomise_parameters(model):
    """Norm weights around 1, every other parameter N(0, 0.15^2), from torch's global RNG."""
    for pname, p in model.named_parameters():
        if "norm" in pname:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        else:
            p.copy_(0.15 * torch.randn_like(p))
    return model


# ---------------------------------------------------------------------------------------
# the tests

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ragged_paged_batch_matches_transformers(name, dtype, tmp_path):
    hf = make_hf_model(name)
    hf.save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    ours = load_model(config, model_dir=str(tmp_path), dtype=dtype, device="cpu", seed=0)
    oracle = hf_oracle(hf, dtype)

    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, 256, (7,), generator=gen).tolist()
    prompt_b = torch.randint(0, 256, (11,), generator=gen).tolist()
    blocks_a, blocks_b = [5, 2], [7, 0, 3]  # non-contiguous, interleaved
    harness = PagedHarness(ours, num_blocks=8, block_size=4)

    step1 = harness.step([(prompt_a, 0, blocks_a), (prompt_b[:5], 0, blocks_b)])
    next_a = int(step1[6].argmax())
    step2 = harness.step([([next_a], 7, blocks_a), (prompt_b[5:], 5, blocks_b)])

    ref_a = hf_logits(oracle, prompt_a + [next_a])
    ref_b = hf_logits(oracle, prompt_b)
    ours_a = torch.cat([step1[:7], step2[:1]])
    ours_b = torch.cat([step1[7:], step2[1:]])
    tol = TOL[dtype]
    torch.testing.assert_close(ours_a, ref_a, rtol=0, atol=tol)
    torch.testing.assert_close(ours_b, ref_b, rtol=0, atol=tol)
    assert ref_b.std() > 0.1  # the comparison is not between near-constant logits


def test_unpatched_transformers_float64_is_close_too(tmp_path):
    """The float64 patches only tighten precision: the stock transformers model agrees to
    float32-level accuracy (this guards the patches against changing semantics)."""
    hf = make_hf_model("qwen2-moe")
    hf.save_pretrained(tmp_path)
    ours = load_model(
        AutoConfig.from_pretrained(tmp_path),
        model_dir=str(tmp_path),
        dtype=torch.float64,
        device="cpu",
    )
    tokens = list(range(3, 40, 3))
    harness = PagedHarness(ours)
    logits = harness.step([(tokens, 0, [1, 4, 9, 2])])
    ref = hf_logits(hf.to(torch.float64), tokens)
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
