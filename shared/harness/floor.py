"""The throughput floor: the least time a workload of requests can take on this model, at
the measured read bandwidth and matmul rate.

The model (issue 21, "throughput toward the floor"):
- FCFS admission into `max_num_seqs` slots, every request admitted at once when they fit;
  a finished request's slot goes to the next waiting one for the next decode step.
- A request's prefill produces its first output token; each later output token is one
  decode step. Its k-th decode step (k = 1 .. n-1) attends over its prompt p plus k
  tokens, so it reads the KV of p + k tokens.
- Each decode step reads the weights once (`weight_bytes`: everything a step reads, the
  LM head included, see ModelExecutor.weight_bytes) and the KV of every live context.
- Prefill is compute: 2 x the matmul parameters a token passes through x prompt tokens,
  causal attention's QK^T and PV (4 x layers x heads x head_dim x p(p+1)/2 per prompt),
  and the LM head for the one token per request it samples.
- floor time = decode bytes / read bandwidth + prefill FLOPs / matmul rate.

The KV total does not depend on the admission order (each request reads the same contexts
whenever it runs); the number of decode steps does, through the slots. MoE models count
the routed experts a token passes through for prefill and every expert for a decode
step's weight read (what a batch that touches them all reads).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the floor needs of a model."""

    weight_bytes: int  # bytes one decode step reads (LM head included)
    kv_bytes_per_token: int  # K and V of one token over every layer
    matmul_params: float  # non-embedding matmul parameters per token (MoE: active experts)
    lm_head_params: int  # hidden x vocab
    num_layers: int
    num_heads: int  # query heads
    head_dim: int


@dataclass(frozen=True)
class Rates:
    read_bytes_per_s: float
    matmul_flops_per_s: float


@dataclass(frozen=True)
class Floor:
    output_tokens: int
    max_num_seqs: int
    decode_steps: int
    weight_bytes_read: float
    kv_bytes_read: float
    prefill_flops: float
    decode_s: float
    prefill_s: float

    @property
    def seconds(self) -> float:
        return self.decode_s + self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": self.seconds, "tokens_per_s": self.tokens_per_s}


def decode_steps(output_lens: Sequence[int], max_num_seqs: int) -> int:
    """Decode steps of FCFS admission into `max_num_seqs` slots: a request of n output
    tokens holds its slot for n - 1 steps (the first token comes from its prefill)."""
    slots = [0] * min(max_num_seqs, len(output_lens))  # the step each slot is free from
    end = 0
    for n in output_lens:
        start = heapq.heappop(slots)
        heapq.heappush(slots, start + n - 1)
        end = max(end, start + n - 1)
    return end


def kv_tokens_read(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """Token reads of KV over every decode step: sum over k = 1 .. n-1 of p + k."""
    return sum((n - 1) * p + (n - 1) * n // 2 for p, n in zip(prompt_lens, output_lens))


def prefill_flops(shape: ModelShape, prompt_lens: Sequence[int]) -> float:
    """GEMMs of every prompt token, causal attention over each prompt, and the LM head
    for the one token each request samples at the end of its prefill."""
    tokens = sum(prompt_lens)
    causal_pairs = sum(p * (p + 1) // 2 for p in prompt_lens)
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * causal_pairs
    return 2 * shape.matmul_params * tokens + attention + 2 * shape.lm_head_params * len(prompt_lens)


def throughput_floor(shape: ModelShape, prompt_lens: Sequence[int], output_lens: Sequence[int],
                     max_num_seqs: int, rates: Rates) -> Floor:
    if len(prompt_lens) != len(output_lens) or min(output_lens, default=1) < 1:
        raise ValueError("one output length >= 1 per prompt")
    steps = decode_steps(output_lens, max_num_seqs)
    weights = float(steps) * shape.weight_bytes
    kv = float(kv_tokens_read(prompt_lens, output_lens)) * shape.kv_bytes_per_token
    flops = prefill_flops(shape, prompt_lens)
    return Floor(
        output_tokens=sum(output_lens), max_num_seqs=max_num_seqs, decode_steps=steps,
        weight_bytes_read=weights, kv_bytes_read=kv, prefill_flops=flops,
        decode_s=(weights + kv) / rates.read_bytes_per_s,
        prefill_s=flops / rates.matmul_flops_per_s,
    )


# ------------------------------------------------------------------ the model's shape


def matmul_params(model: torch.nn.Module) -> float:
    """Matmul parameters one token passes through, the embedding and LM head left out:
    every Linear weight (biases are adds), and of each FusedMoE the top_k experts' share."""
    from shared.model.layers import Linear
    from shared.model.moe import FusedMoE

    head = getattr(model, "lm_head", None)
    total = 0.0
    for module in model.modules():
        if isinstance(module, FusedMoE):
            experts = module.gate_up_proj.numel() + module.down_proj.numel()
            total += experts * module.top_k / module.num_experts
        elif isinstance(module, Linear) and module is not head:
            total += module.weight.numel()
    return total


def model_shape(model: torch.nn.Module, model_config: Any, weight_bytes: int) -> ModelShape:
    """From a built model (any device, `meta` included) and its ModelConfig."""
    mc = model_config
    element = torch.empty((), dtype=mc.torch_dtype).element_size()
    return ModelShape(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=2 * mc.num_hidden_layers * mc.num_kv_heads * mc.head_dim * element,
        matmul_params=matmul_params(model),
        lm_head_params=mc.hidden_size * mc.vocab_size,
        num_layers=mc.num_hidden_layers, num_heads=mc.num_attention_heads, head_dim=mc.head_dim,
    )


def engine_shape(engine: Any) -> ModelShape:
    """The shape of an LLMEngine's model, weight bytes as its decode floor counts them."""
    executor = engine.runner.executor
    return model_shape(executor.model, engine.model_config,
                       executor.weight_bytes(include_embedding=False))


# ------------------------------------------------------------------ the embed floor


@dataclass(frozen=True)
class GemmFloor:
    """The embed workload's floor (issue 24): a prefill-bound run of `prompts` prompts of
    `prompt_tokens` tokens in all can take no less than prompt tokens x 2 x the matmul
    parameters a token passes through, at the measured GEMM rate. Attention and the
    embedding lookup are left out (the floor stays below the work), and a pooling engine
    runs no LM head (`parameters`, every parameter of the model, is reported beside it)."""

    prompts: int
    prompt_tokens: int
    matmul_params: float
    parameters: int
    gemm_flops_per_s: float

    @property
    def flops(self) -> float:
        return self.prompt_tokens * 2 * self.matmul_params

    @property
    def seconds(self) -> float:
        return self.flops / self.gemm_flops_per_s

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "flops": self.flops, "seconds": self.seconds,
                "embeddings_per_s": self.prompts / self.seconds,
                "prompt_tokens_per_s": self.prompt_tokens / self.seconds}


def parameter_count(model: torch.nn.Module) -> int:
    """Every parameter of the model, a tied embedding counted once."""
    return sum(p.numel() for p in model.parameters())
