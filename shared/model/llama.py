"""Llama-family decoders: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias) and
Qwen3ForCausalLM (per-head RMSNorm on q and k before RoPE).

One flat ragged batch per forward: input_ids [T], positions [T] -> hidden [T, hidden].
Attention metadata (which tokens belong to which request, where the KV goes) comes from
the forward context, read by each layer's `Attention` module.

Tensor parallel (the model built inside `building_for(group)`): each rank runs its heads
and its slice of the MLP (shared/model/parallel_layers.py); o_proj and down_proj sum the
ranks' partial products (all_reduce), so the residual stream, the norms and the final
hidden states are the same on every rank, and the LM head gathers the full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from shared.attention.layer import Attention
from shared.model.kernels import fused_ops, gemv
from shared.model.layers import (
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    check_no_sliding_window,
    check_silu,
    get_head_dim,
    load_hf_weights,
    make_rope,
)
from shared.model.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul. Tensor
    parallel: gate|up column-parallel, down row-parallel (one all_reduce, or none with
    reduce_results=False: the caller sums it with other partial results first).
    `what` names the config field of the intermediate size in a divisibility error."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *,
                 what: str = "intermediate_size", reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, what=what)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, what=what, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_gemv(self, stream: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """Small-batch path, two launches: norm + gate_up + SiLU-and-mul (per rank: the
        rank's gate and up rows), then down + the residual add (distributed: the partial
        down is all-reduced before the add). Takes the residual stream, returns the
        stream after the MLP."""
        gate_up = self.gate_up_proj
        act = gemv.gemv(stream, gate_up.weight, gate_up.bias, norm_weight=norm.weight,
                        eps=norm.eps, epilogue="silu")
        return self.down_proj.forward_gemv_residual(act, stream)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg,
        rope: RotaryEmbedding,
        prefix: str,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
    ):
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = get_head_dim(cfg)
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias)
        # This rank's heads (all of them in one process): everything below is per rank.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, cfg.hidden_size, bias=o_bias,
            what="num_attention_heads * head_dim")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rope  # one module shared by every layer (one cos/sin cache)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, f"{prefix}.attn"
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.pre_attention(positions, hidden_states)
        return self.post_attention(self.attn(q, k, v))

    # The two halves around the attention call: the piecewise CUDA-graph path captures
    # them and runs `self.attn` eagerly in between (shared/runtime/piecewise_graphs.py).
    def pre_attention(
        self, positions: torch.Tensor, hidden_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> q [T, H*D], k [T, Hkv*D], v [T, Hkv*D]: the qkv matmul,
        q/k norm (Qwen3) and RoPE."""
        qkv = self.qkv_proj(hidden_states)
        if fused_ops.use_fused(qkv):
            return self._norm_rope_fused(positions, qkv)
        return self._norm_rope_torch(positions, qkv)

    def post_attention(self, attn_output: torch.Tensor) -> torch.Tensor:
        """attention output [T, H*D] -> [T, hidden]."""
        return self.o_proj(attn_output)

    def pre_attention_gemv(
        self, positions: torch.Tensor, stream: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Small-batch path: the input norm, the qkv GEMV and (without q/k norm, full
        rotary) RoPE in one launch; Qwen3's q/k norm + RoPE stay one more launch."""
        rope, proj = self.rotary_emb, self.qkv_proj
        if self.q_norm is None and rope.rotary_dim == self.head_dim:
            qkv = gemv.gemv(
                stream, proj.weight, proj.bias, norm_weight=norm.weight, eps=norm.eps,
                epilogue="rope", positions=positions, cos_sin_cache=rope.cos_sin_cache,
                head_dim=self.head_dim, num_rope_heads=self.num_heads + self.num_kv_heads,
            )
            return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qkv = gemv.gemv(stream, proj.weight, proj.bias, norm_weight=norm.weight, eps=norm.eps)
        return self._norm_rope_fused(positions, qkv)

    def _norm_rope_fused(
        self, positions: torch.Tensor, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One launch: q/k norm (Qwen3) + RoPE in place in qkv; q, k, v are its slices."""
        rope = self.rotary_emb
        return fused_ops.qk_norm_rope(
            qkv, positions, rope.cos_sin_cache,
            self.num_heads, self.num_kv_heads, self.head_dim, rope.rotary_dim,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
            0.0 if self.q_norm is None else self.q_norm.eps,
        )

    def _norm_rope_torch(
        self, positions: torch.Tensor, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            # Qwen3: normalise each head's vector before the rotation.
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, self_attn: LlamaAttention, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused-residual form: takes the previous sublayer's output and the residual
        stream before it (None for the first layer, whose input is the stream itself);
        returns (this layer's MLP output, the stream before it). Each norm does the pending
        residual add, so h + attn(norm(h)) is the same sum, just computed one call later."""
        q, k, v, residual = self.pre_attention(positions, hidden_states, residual)
        return self.post_attention(self.self_attn.attn(q, k, v), residual)

    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before the attention call: (pending residual add +) input norm and
        the attention's pre_attention. -> (q, k, v, residual stream)."""
        if residual is None and gemv.use_gemv(hidden_states):
            # Small batch: the previous layer's GEMV epilogue already added the residual,
            # so hidden_states is the stream itself.
            q, k, v = self.self_attn.pre_attention_gemv(
                positions, hidden_states, self.input_layernorm
            )
            return q, k, v, hidden_states
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        q, k, v = self.self_attn.pre_attention(positions, hidden_states)
        return q, k, v, residual

    def post_attention(
        self, attn_output: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after it: o_proj, residual add + norm, MLP. -> (MLP output, stream)."""
        if gemv.use_gemv(attn_output):
            return self._post_attention_gemv(attn_output, residual)
        hidden_states = self.self_attn.post_attention(attn_output)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def _post_attention_gemv(
        self, attn_output: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Small batch: o_proj adds the residual in its epilogue (distributed: after the
        all_reduce of its partial product); a dense MLP then runs as
        two fused GEMVs and returns the finished stream with no pending residual (None),
        which is what the next layer's pre_attention (or the final norm) expects."""
        stream = self.self_attn.o_proj.forward_gemv_residual(attn_output, residual)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp.forward_gemv(stream, self.post_attention_layernorm), None
        return self.mlp(self.post_attention_layernorm(stream)), stream  # MoE


class LlamaModel(nn.Module):
    def __init__(self, cfg, make_layer: Callable[[int, str], LlamaDecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            make_layer(i, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        return self._final_norm(hidden_states, residual)

    def _final_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:  # no layers
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    # ---- the piecewise split: segments between the attention calls -------------------
    # Segment 0 = embedding + layer 0 up to its attention; segment i (1..L-1) = the rest
    # of layer i-1 + layer i up to its attention; segment L = the rest of layer L-1 + the
    # final norm. Attention i runs between segments i and i+1. Only the segments depend
    # on nothing but the token count, so only they can be captured per padded size.
    @property
    def num_segments(self) -> int:
        return len(self.layers) + 1

    def forward_segment(
        self,
        index: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_output: torch.Tensor | None,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor:
        """Segment `index`. Segment 0 reads input_ids (and ignores attn_output/residual);
        a later one reads the previous attention's output and the residual stream.
        -> (q, k, v, residual) for the next attention, or, for the last segment, the
        final hidden states [T, hidden]. With no layers, segment 0 is the last one."""
        if not 0 <= index < self.num_segments:
            raise IndexError(f"segment {index} out of range 0..{self.num_segments - 1}")
        if index == 0:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = self.layers[index - 1].post_attention(attn_output, residual)
        if index < len(self.layers):
            return self.layers[index].pre_attention(positions, hidden_states, residual)
        return self._final_norm(hidden_states, residual)

    def attention(
        self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Attention of layer `index` (KV write + paged attention, metadata from the
        forward context), between segments index and index + 1 of the eager split.
        The piecewise graphs take its halves apart: write_kv is recorded in segment
        index's graph, attend runs eagerly."""
        return self.layers[index].self_attn.attn(q, k, v)

    def write_kv(
        self, index: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """The KV-write half of attention `index` (what a piecewise graph records at the
        end of segment `index`)."""
        self.layers[index].self_attn.attn.write_new_kv(k, v, slot_mapping)

    def attend(self, index: int, q: torch.Tensor, output: torch.Tensor) -> None:
        """The attention half of attention `index`, into output (its KV already written)."""
        self.layers[index].self_attn.attn.attend(q, output)

    def forward_piecewise_eager(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """forward() through the piecewise split, all eager: the same ops in the same
        order, so the same numbers (the oracle for the graphed path)."""
        attn_output = residual = None
        for index in range(len(self.layers)):
            q, k, v, residual = self.forward_segment(
                index, input_ids, positions, attn_output, residual
            )
            attn_output = self.attention(index, q, k, v)
        return self.forward_segment(
            len(self.layers), input_ids, positions, attn_output, residual
        )


class LlamaForCausalLM(nn.Module):
    """The base decoder. Subclasses change the attention options and the MLP per layer."""

    def __init__(self, hf_config):
        super().__init__()
        check_silu(hf_config)
        check_no_sliding_window(hf_config)
        self.config = hf_config
        self.rope = make_rope(hf_config)
        self.model = LlamaModel(hf_config, self._make_layer)
        self._make_head(hf_config)

    # --- per-architecture hooks -----------------------------------------------------
    def _make_head(self, cfg) -> None:
        """The LM head, tied to the embedding when the config says so. The pooling models
        (shared/model/pooling_models.py) build their score head here instead, so that no
        vocab-sized matrix is ever allocated for them."""
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _attention_options(self, cfg) -> dict:
        bias = bool(getattr(cfg, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}

    def _make_mlp(self, cfg, layer_idx: int, prefix: str) -> nn.Module:
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False))

    def _rename(self, name: str) -> str | None:
        """Checkpoint name -> our name; None skips the tensor."""
        if "rotary_emb.inv_freq" in name:
            return None  # old checkpoints store the RoPE table; we compute our own
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # tied: the embedding is the head
        return name

    # --- the interface the runners call --------------------------------------------
    def _make_layer(self, layer_idx: int, prefix: str) -> LlamaDecoderLayer:
        cfg = self.config
        attn = LlamaAttention(cfg, self.rope, f"{prefix}.self_attn", **self._attention_options(cfg))
        return LlamaDecoderLayer(cfg, attn, self._make_mlp(cfg, layer_idx, f"{prefix}.mlp"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids int [T], positions int64 [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def forward_piecewise_eager(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """forward() run segment by segment (see LlamaModel.forward_segment)."""
        return self.model.forward_piecewise_eager(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model dtype (the full vocab on every rank)."""
        return self.lm_head(hidden_states)

    def attention_layers(self) -> dict[str, Attention]:
        return {m.layer_name: m for m in self.modules() if isinstance(m, Attention)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_hf_weights(self, weights, self._rename)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def _attention_options(self, cfg) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


class Qwen3ForCausalLM(LlamaForCausalLM):
    def _attention_options(self, cfg) -> dict:
        bias = bool(getattr(cfg, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
