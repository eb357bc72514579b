"""Mixture-of-experts decoders: MixtralForCausalLM and Qwen2MoeForCausalLM (routed experts
plus a shared expert scaled by a sigmoid gate).

Expert weights are fused per layer: gate_up_proj [E, 2I, H] and down_proj [E, H, I].
Two ways to run them, with the same arithmetic per token (expert output times routing
weight, added to the token's sum in expert order):
- `moe_sparse`: each expert runs only on the tokens routed to it. It reads the per-expert
  counts on the host (a sync), so it is used on the CPU only.
- `moe_dense`: every expert runs on every token and is weighted by the sparse routing
  weights (zero for an unrouted expert). Fixed shapes and no host reads, so it can be
  captured in a CUDA graph; used on every CUDA path, eager included, so that a batch gives
  the same numbers whether or not it is replayed from a graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.layers import Linear, check_no_sliding_window, compute_dtype, silu_and_mul
from shared.model.llama import LlamaForCausalLM, LlamaMLP


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k. -> (weights [T, k] dtype, ids [T, k] int64)."""
    probs = torch.softmax(router_logits.to(compute_dtype(router_logits.dtype)), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def _run_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    # silu(gate) * up: one fused launch on CUDA, the same arithmetic elsewhere.
    return F.linear(silu_and_mul(F.linear(x, w13)), w2)


def moe_sparse(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int64
) -> torch.Tensor:
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # host sync
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order]
    out = torch.zeros_like(hidden)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        tokens = token_of[rows]
        y = _run_expert(hidden[tokens], w13[expert], w2[expert]) * weight_of[rows, None]
        out.index_add_(0, tokens, y)  # a token appears at most once per expert
        start += count
    return out


def moe_dense(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int64
) -> torch.Tensor:
    num_experts = w13.shape[0]
    dense_weights = torch.zeros(
        hidden.shape[0], num_experts, dtype=topk_weights.dtype, device=hidden.device
    ).scatter_(1, topk_ids, topk_weights)  # [T, E], zero where the token is not routed
    out = torch.zeros_like(hidden)
    for expert in range(num_experts):
        out += _run_expert(hidden, w13[expert], w2[expert]) * dense_weights[:, expert, None]
    return out


class FusedMoE(nn.Module):
    """The routed experts of one layer: router logits in, weighted expert sum out."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def gate_up_rows(self, half: int) -> slice:
        """Rows of gate_up_proj[e] holding the gate (half 0) or up (half 1) projection."""
        return slice(half * self.intermediate_size, (half + 1) * self.intermediate_size)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            router_logits, self.top_k, self.renormalize, hidden_states.dtype
        )
        run = moe_dense if hidden_states.is_cuda else moe_sparse
        return run(hidden_states, self.gate_up_proj, self.down_proj, weights, ids)


class MixtralMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_local_experts)
        self.experts = FusedMoE(
            cfg.num_local_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.intermediate_size,
            renormalize=True,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedMoE(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            renormalize=bool(cfg.norm_topk_prob),
        )
        self.shared_expert = LlamaMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, self.gate(x))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


class MixtralForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config):
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and window < hf_config.max_position_embeddings:
            raise NotImplementedError(
                f"MixtralForCausalLM: sliding_window={window} is not implemented (set it to None)"
            )
        super().__init__(hf_config)

    def _attention_options(self, cfg) -> dict:
        return {"qkv_bias": False, "o_bias": False, "qk_norm": False}

    def _make_mlp(self, cfg, layer_idx: int, prefix: str) -> nn.Module:
        return MixtralMoE(cfg)

    def _rename(self, name: str) -> str | None:
        # Our layer calls its feed-forward `mlp` whatever the architecture.
        return super()._rename(name.replace(".block_sparse_moe.", ".mlp."))


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config):
        check_no_sliding_window(hf_config)
        super().__init__(hf_config)

    def _attention_options(self, cfg) -> dict:
        return {"qkv_bias": bool(getattr(cfg, "qkv_bias", True)), "o_bias": False, "qk_norm": False}

    def _make_mlp(self, cfg, layer_idx: int, prefix: str) -> nn.Module:
        # Dense layers: listed in mlp_only_layers, or off the decoder_sparse_step grid.
        mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        if layer_idx not in mlp_only and cfg.num_experts > 0 and (layer_idx + 1) % step == 0:
            return Qwen2MoeSparseMoeBlock(cfg)
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
