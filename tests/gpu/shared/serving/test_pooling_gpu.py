"""Pooling on the GPU (float32, TRITON attention, piecewise graphs where a prefill batch
fits): V1 == V2 on embed and classify, and the embeddings match transformers' pooled
hidden states (GPU machine only)."""

from __future__ import annotations

import pytest
import torch

from shared.serving.llm import LLM
from tests.shared.serving.test_pooling_engine import PROMPTS, SMALL, _classifier_dir, _hf_hidden

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def seq_dir(tmp_path_factory) -> str:
    return _classifier_dir(tmp_path_factory, "seq")


def _outs(path, runner, task, **kw):
    llm = LLM(model=path, dtype="float32", device="cuda", seed=0, model_runner=runner,
              pooling_task=task, num_gpu_blocks_override=256, **{**SMALL, **kw})
    return [o.outputs.data for o in llm.encode(PROMPTS * 3)]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embed_v1_equals_v2_and_transformers_cuda(llama_dir, pooling_type):
    cfg = {"pooler_config": {"pooling_type": pooling_type}}
    v1, v2 = _outs(llama_dir, "v1", "embed", **cfg), _outs(llama_dir, "v2", "embed", **cfg)
    assert all(torch.equal(a, b) for a, b in zip(v1, v2))
    for prompt, out in zip(PROMPTS, v1):
        hidden = _hf_hidden(llama_dir, prompt)
        pooled = hidden[-1] if pooling_type == "LAST" else hidden.mean(0)
        assert (out.double() - pooled / pooled.norm()).abs().max() < 1e-4


def test_classify_v1_equals_v2_cuda(seq_dir):
    v1, v2 = _outs(seq_dir, "v1", "classify"), _outs(seq_dir, "v2", "classify")
    assert all(torch.equal(a, b) for a, b in zip(v1, v2))
