"""Our five architectures vs Hugging Face transformers on tiny random models.

Each model is saved with `save_pretrained` (safetensors), loaded with our loader, and run
as a ragged batch through the paged KV cache with the TORCH backend:
  step 1: prefill request A fully + the first chunk of request B,
  step 2: decode A (one token) + the rest of B's prompt (a chunk after a cached prefix),
with non-contiguous block ids. Every position's logits must match transformers' forward
over the full sequences: float64 to 1e-10, float32 to 1e-4.
"""

from __future__ import annotations

import math
import types

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

from shared.attention.metadata import CommonAttentionMetadata
from shared.attention.torch_backend import TorchBackend
from shared.model import load_model
from shared.runtime.forward_context import set_forward_context

# ---------------------------------------------------------------------------------------
# the paged-cache harness (also used by the SmolLM2 and weights tests)


class PagedHarness:
    """Binds a TORCH backend and a KV cache to every attention layer of `model`, and runs
    steps of (token chunk, start position, block ids) rows, decodes first."""

    def __init__(self, model, num_blocks: int = 16, block_size: int = 4):
        self.model = model
        self.block_size = block_size
        self.layers = model.attention_layers()
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.device = device
        for layer in self.layers.values():
            layer.bind_backend(TorchBackend())
            shape = (2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_kv_cache(torch.zeros(shape, dtype=dtype, device=device))

    def metadata(self, rows: list[tuple[list[int], int, list[int]]]) -> CommonAttentionMetadata:
        bs = self.block_size
        q_lens = [len(tokens) for tokens, _, _ in rows]
        seq_lens = [start + n for (_, start, _), n in zip(rows, q_lens)]
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        width = max(len(blocks) for _, _, blocks in rows)
        table = [blocks + [0] * (width - len(blocks)) for _, _, blocks in rows]
        slots = [
            blocks[p // bs] * bs + p % bs
            for (_, start, blocks), n in zip(rows, q_lens)
            for p in range(start, start + n)
        ]
        num_decodes = sum(1 for n in q_lens if n == 1)
        assert q_lens[:num_decodes] == [1] * num_decodes, "decode rows must come first"
        dev = self.device
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32)
        return CommonAttentionMetadata(
            query_start_loc=qsl_t.to(dev),
            seq_lens=seq_t.to(dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_reqs=len(rows),
            num_actual_tokens=qsl[-1],
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            num_prefills=len(rows) - num_decodes,
            num_decode_tokens=num_decodes,
            block_size=bs,
            query_start_loc_cpu=qsl_t,
            seq_lens_cpu=seq_t,
        )

    @torch.no_grad()
    def step(self, rows: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """-> logits [T, vocab] for every scheduled token, in row order."""
        common = self.metadata(rows)
        md = TorchBackend().make_builder(self.device).build(common)
        ids = torch.tensor([t for tokens, _, _ in rows for t in tokens], device=self.device)
        positions = torch.tensor(
            [p for tokens, start, _ in rows for p in range(start, start + len(tokens))],
            dtype=torch.int64,
            device=self.device,
        )
        with set_forward_context(md, list(self.layers), ids.shape[0]):
            hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden)


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
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.eval()


# ---------------------------------------------------------------------------------------
# float64 oracle: transformers computes RMSNorm, RoPE frequencies and MoE routing in
# float32 even in a float64 model. These patches keep its semantics and only make those
# spots float64, so the comparison can be exact to ~1e-12.


def _exact_inv_freq(module) -> torch.Tensor:
    rp = module.config.rope_parameters
    dim = module.inv_freq.shape[0] * 2
    freqs = [1.0 / rp["rope_theta"] ** (i / dim) for i in range(0, dim, 2)]
    if rp["rope_type"] == "llama3":
        f, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        orig = rp["original_max_position_embeddings"]
        out = []
        for fr in freqs:
            wavelen = 2 * math.pi / fr
            if wavelen < orig / hi:
                out.append(fr)
            elif wavelen > orig / lo:
                out.append(fr / f)
            else:
                s = (orig / wavelen - lo) / (hi - lo)
                out.append((1 - s) * fr / f + s * fr)
        freqs = out
    exact = torch.tensor(freqs, dtype=torch.float64)
    # transformers stays the authority on the formula: its float32 table must agree
    torch.testing.assert_close(exact, module.inv_freq.double(), rtol=2e-6, atol=0)
    return exact


def _rms_forward(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rope_forward(self, x, position_ids):
    freqs = position_ids[..., None].double() * self.exact_inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _router_forward(self, hidden_states):
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


def make_float64_exact(model) -> None:
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_forward, module)
        elif kind.endswith("RotaryEmbedding"):
            module.exact_inv_freq = _exact_inv_freq(module)
            module.forward = types.MethodType(_rope_forward, module)
        elif kind.endswith("TopKRouter"):
            module.forward = types.MethodType(_router_forward, module)


def hf_oracle(model, dtype: torch.dtype):
    model = model.to(dtype)
    if dtype == torch.float64:
        make_float64_exact(model)
    return model


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]


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


@pytest.mark.gpu
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
