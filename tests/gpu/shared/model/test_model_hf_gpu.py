"""Our decoders on the GPU (GPU machine only): a decode forward of each kind of model
(dense, tied embeddings, MoE) is CUDA-graph capturable and replays to the eager result.
The tiny configs are those of tests/shared/model/test_model_hf.py."""

from __future__ import annotations

import pytest
import torch

from shared.attention.torch_backend import TorchBackend
from shared.model import load_model
from shared.runtime.forward_context import set_forward_context
from tests.oracles.paged_attention import PagedHarness
from tests.shared.model.test_model_hf import CONFIGS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["llama", "qwen3-tied", "qwen2-moe"])
def test_forward_is_cuda_graph_capturable(name):
    """A decode forward captures (no host syncs in the model) and replays to the eager
    result. Uses random weights in bf16 on the GPU, attention through TORCH."""
    dev = torch.device("cuda")
    model = load_model(
        CONFIGS[name](), load_format="dummy", dtype=torch.bfloat16, device=dev, seed=0
    )
    harness = PagedHarness(model, num_blocks=16, block_size=4)
    harness.step([(list(range(1, 9)), 0, [2, 5]), (list(range(9, 14)), 0, [7, 3])])
    rows = [([3], 8, [2, 5, 1]), ([4], 5, [7, 3])]
    md = TorchBackend().make_builder(dev).build(harness.metadata(rows))
    ids = torch.tensor([3, 4], device=dev)
    positions = torch.tensor([8, 5], dtype=torch.int64, device=dev)
    with torch.no_grad(), set_forward_context(md, list(harness.layers), 2):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture stream
            eager = model.compute_logits(model(ids, positions)).clone()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model.compute_logits(model(ids, positions))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(eager.float()).all()
    torch.testing.assert_close(captured, eager)
