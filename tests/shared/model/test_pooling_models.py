"""The classification models (shared/model/pooling_models.py) vs Hugging Face transformers
on tiny random checkpoints, in float64.

Each transformers *ForSequenceClassification / *ForTokenClassification model is saved with
`save_pretrained` (safetensors), loaded with our loader, and run as a ragged batch through
the paged KV cache with the TORCH backend (tests/oracles/paged_attention.PagedHarness):
  step 1: prompt A whole + the first chunk of prompt B,
  step 2: the rest of B (a chunk after a cached prefix).
Against transformers' forward over each prompt alone (float64, with the patches of
tests/oracles/hf_float64.py), to 1e-9:
- our final hidden states equal the base model's last_hidden_state (after the final norm);
- sequence classification: pooler_head on each prompt's LAST token equals transformers'
  logits (an unpadded prompt: it pools at the last non-pad token, which is the last one);
- token classification: pooler_head on every token equals transformers' per-token logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from policy.model_config import build_model_config
from shared.model import load_model
from shared.model.pooling_models import ClassificationHead
from tests.oracles.hf_float64 import hf_oracle
from tests.oracles.paged_attention import PagedHarness
from tests.shared.model.test_model_hf import COMMON as HF_COMMON
from tests.shared.model.test_model_hf import randomise_parameters

COMMON = {**HF_COMMON, "pad_token_id": 0}
FAMILIES = {
    "Llama": lambda **kw: LlamaConfig(**COMMON, attention_bias=True, **kw),
    "Qwen2": lambda **kw: Qwen2Config(**COMMON, **kw),
    # tied embeddings in the config: a classification model has no LM head to tie
    "Qwen3": lambda **kw: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True, **kw),
}
HEADS = {  # head -> (transformers auto class, num_labels)
    "SequenceClassification": (AutoModelForSequenceClassification, 3),
    "TokenClassification": (AutoModelForTokenClassification, 5),
}
CASES = [(family, head) for family in FAMILIES for head in HEADS]
TOL = 1e-9

PROMPT_A = [5, 17, 201, 42, 7, 99, 3]
PROMPT_B = [11, 250, 8, 64, 128, 33, 1, 77, 190, 4, 56]  # no pad token (0) in either
SPLIT = 5  # B's first chunk


def make_hf_model(family: str, head: str, seed: int = 0, **config_kw):
    """A transformers classification model with every parameter randomised (norm weights
    around 1, nonzero biases), so that no weight the loader might drop is a no-op."""
    torch.manual_seed(seed)
    auto_cls, num_labels = HEADS[head]
    cfg = FAMILIES[family](num_labels=num_labels, architectures=[f"{family}For{head}"], **config_kw)
    model = auto_cls.from_config(cfg, attn_implementation="sdpa")
    return randomise_parameters(model).eval()  # eval: the token head's dropout is the identity


def load_ours(hf, path, dtype=torch.float64):
    hf.save_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    return load_model(config, model_dir=str(path), dtype=dtype, device="cpu")


def ragged_hidden(ours, piecewise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Our final hidden states of A and B, [len, hidden] each, run as described above."""
    harness = PagedHarness(ours, num_blocks=8, block_size=4)
    blocks_a, blocks_b = [5, 2], [7, 0, 3]  # non-contiguous, interleaved
    step1 = harness.hidden([(PROMPT_A, 0, blocks_a), (PROMPT_B[:SPLIT], 0, blocks_b)], piecewise)
    step2 = harness.hidden([(PROMPT_B[SPLIT:], SPLIT, blocks_b)], piecewise)
    n = len(PROMPT_A)
    return step1[:n], torch.cat([step1[n:], step2])


@torch.no_grad()
def hf_outputs(oracle, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(last_hidden_state [T, hidden], logits: [num_labels] or [T, num_labels])."""
    ids = torch.tensor([tokens])
    return oracle.model(ids).last_hidden_state[0], oracle(ids).logits[0]


@pytest.mark.parametrize(("family", "head"), CASES, ids=[f"{f}-{h}" for f, h in CASES])
def test_matches_transformers_float64(family, head, tmp_path):
    hf = make_hf_model(family, head)
    ours = load_ours(hf, tmp_path)
    oracle = hf_oracle(hf, torch.float64)
    assert type(ours).__name__ == f"{family}For{head}"
    assert ours.num_labels == HEADS[head][1] and not hasattr(ours, "lm_head")

    for hidden, prompt in zip(ragged_hidden(ours), (PROMPT_A, PROMPT_B)):
        ref_hidden, ref_logits = hf_outputs(oracle, prompt)
        torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=TOL)
        if head == "SequenceClassification":
            assert ref_logits.shape == (ours.num_labels,)
            logits = ours.pooler_head(hidden[-1:])[0]
        else:
            assert ref_logits.shape == (len(prompt), ours.num_labels)
            logits = ours.pooler_head(hidden)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=TOL)
        assert ref_logits.std() > 0.1  # the comparison is not between near-constant logits


def test_token_head_without_bias(tmp_path):
    """config.token_classification_bias=False: transformers builds no score.bias, nor do we."""
    hf = make_hf_model("Llama", "TokenClassification", token_classification_bias=False)
    assert hf.score.bias is None
    ours = load_ours(hf, tmp_path)
    assert ours.score.bias is None
    _, hidden_b = ragged_hidden(ours)
    _, ref_logits = hf_outputs(hf_oracle(hf, torch.float64), PROMPT_B)
    torch.testing.assert_close(ours.pooler_head(hidden_b), ref_logits, rtol=0, atol=TOL)


def test_piecewise_eager_is_forward(tmp_path):
    ours = load_ours(make_hf_model("Qwen3", "SequenceClassification"), tmp_path)
    for eager, split in zip(ragged_hidden(ours), ragged_hidden(ours, piecewise=True)):
        assert torch.equal(eager, split)


def test_compute_logits_raises(tmp_path):
    ours = load_ours(make_hf_model("Qwen2", "TokenClassification"), tmp_path)
    with pytest.raises(TypeError, match="classification model: it has no LM head"):
        ours.compute_logits(torch.zeros(2, 64, dtype=torch.float64))


def test_extra_lm_head_is_skipped_and_missing_score_refused(tmp_path):
    """A causal LM's lm_head next to `score` is ignored; a causal LM checkpoint (no score)
    declared as a classifier fails naming the missing head."""
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON))
    lm.save_pretrained(tmp_path / "lm")
    config = AutoConfig.from_pretrained(tmp_path / "lm")
    config.architectures = ["LlamaForSequenceClassification"]
    with pytest.raises(ValueError, match="score.weight"):
        load_model(config, model_dir=str(tmp_path / "lm"), dtype=torch.float64)

    hf = make_hf_model("Llama", "SequenceClassification")
    ours = load_ours(hf, tmp_path / "cls")
    from safetensors.torch import load_file, save_file

    file = tmp_path / "cls" / "model.safetensors"
    tensors = load_file(file)
    tensors["lm_head.weight"] = torch.randn(256, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    again = load_model(ours.config, model_dir=str(tmp_path / "cls"), dtype=torch.float64)
    assert torch.equal(again.score.weight, ours.score.weight)


@pytest.mark.parametrize(("preset", "head", "num_labels"), [
    ("tiny-llama-cls", "sequence_classification", 3),
    ("tiny-llama-token-cls", "token_classification", 5),
])
def test_dummy_weights_cover_the_head(preset, head, num_labels):
    """The presets load with seeded dummy weights: the score head is drawn from the seed
    (not left uninitialised) at the scale of every other matrix, and the model runs."""
    mc = build_model_config(preset, "float64", "cpu", None)
    assert (mc.pooling_head, mc.num_labels) == (head, num_labels)

    def dummy(seed: int):
        return load_model(mc.hf_config, load_format="dummy", dtype=torch.float64, seed=seed)

    ours, twin, other = dummy(0), dummy(0), dummy(1)
    assert isinstance(ours, ClassificationHead) and ours.pooling_head == head
    assert ours.score.weight.shape == (num_labels, mc.hidden_size)
    assert torch.equal(ours.score.weight, twin.score.weight)
    assert not torch.equal(ours.score.weight, other.score.weight)
    std = float(ours.score.weight.std())
    assert 0.5 < std * mc.hidden_size**0.5 < 1.5  # N(0, 1/fan_in)
    if head == "token_classification":
        assert torch.equal(ours.score.bias, twin.score.bias) and ours.score.bias.abs().max() > 0
    else:
        assert ours.score.bias is None
    hidden_a, _ = ragged_hidden(ours)
    logits = ours.pooler_head(hidden_a)
    assert logits.shape == (len(PROMPT_A), num_labels) and torch.isfinite(logits).all()
