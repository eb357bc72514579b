"""Mixture-of-experts decoders: MixtralForCausalLM and Qwen2MoeForCausalLM (routed experts
plus a shared expert scaled by a sigmoid gate).

Expert weights are fused per layer: gate_up_proj [E, 2I, H] and down_proj [E, H, I].
Tensor parallel: every rank holds every expert, split along its intermediate dimension
(gate_up_proj [E, 2I/N, H]: the rank's gate rows then its up rows; down_proj [E, H, I/N]),
so each rank's weighted sum is a partial sum, all-reduced once per layer; the router is
replicated (the same routing on every rank).
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
from torch import nn

from shared.distributed.group import current_tp_group
from shared.model.layers import (
    Linear,
    check_no_sliding_window,
    compute_dtype,
    matmul,
    silu_and_mul,
)
from shared.model.llama import LlamaForCausalLM, LlamaMLP
from shared.model.sharding import ShardSpec, set_shard_spec


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
    # silu(gate) * up: one fused launch on CUDA, the same arithmetic elsewhere. `matmul`:
    # the batch-invariant matmul in that mode (the sparse path's expert batches are the
    # tokens routed to it, whose count depends on the whole batch), else F.linear.
    return matmul(silu_and_mul(matmul(x, w13)), w2)


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
    """The routed experts of one layer: router logits in, weighted expert sum out (this
    rank's slice of every expert; summed over the ranks unless reduce_results=False, for a
    block that adds more partial sums first). `what` names the config field of the
    intermediate size in a divisibility error."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        *,
        what: str = "intermediate_size",
        reduce_results: bool = True,
    ):
        super().__init__()
        tp = current_tp_group()
        local = tp.shard(intermediate_size, what)
        self.tp_group = tp
        self.reduce_results = reduce_results
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = local  # this rank's share
        self.total_intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, local), requires_grad=False
        )
        # Logical rows: gate_up [E*2I, H] (expert e: gate rows e*2I.., up rows e*2I + I..),
        # down [E*H, I] with the rank's columns.
        first = tp.rank * local
        gate_up_rows = tuple(
            (e * 2 * intermediate_size + half * intermediate_size + first,
             e * 2 * intermediate_size + half * intermediate_size + first + local)
            for e in range(num_experts) for half in (0, 1))
        set_shard_spec(self.gate_up_proj, ShardSpec(
            (num_experts, 2 * intermediate_size, hidden_size), gate_up_rows, (0, hidden_size)))
        set_shard_spec(self.down_proj, ShardSpec(
            (num_experts, hidden_size, intermediate_size), ((0, num_experts * hidden_size),),
            (first, first + local)))

    def gate_up_rows(self, half: int) -> slice:
        """Rows of the LOGICAL gate_up_proj[e] holding the gate (half 0) or up (half 1)
        projection: what a checkpoint's per-expert tensor fills."""
        size = self.total_intermediate_size
        return slice(half * size, (half + 1) * size)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            router_logits, self.top_k, self.renormalize, hidden_states.dtype
        )
        run = moe_dense if hidden_states.is_cuda else moe_sparse
        out = run(hidden_states, self.gate_up_proj, self.down_proj, weights, ids)
        return self.tp_group.all_reduce(out) if self.reduce_results else out


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
        self.tp_group = current_tp_group()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        # Routed and shared expert both leave partial sums: one all_reduce for the block.
        self.experts = FusedMoE(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            renormalize=bool(cfg.norm_topk_prob),
            what="moe_intermediate_size",
            reduce_results=False,
        )
        self.shared_expert = LlamaMLP(
            cfg.hidden_size, cfg.shared_expert_intermediate_size,
            what="shared_expert_intermediate_size", reduce_results=False)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1)  # replicated: a per-token scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, self.gate(x))
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp_group.all_reduce(routed + shared)


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
