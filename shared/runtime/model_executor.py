"""The part of a runner that both runners share: the model, its attention layers, the
attention backend, the paged KV cache, and one forward under a forward context.

A runner owns one ModelExecutor. Everything here is independent of how a runner keeps
request state or prepares inputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shared.attention.metadata import CommonAttentionMetadata
from shared.attention.selector import get_attn_backend
from shared.distributed.group import building_for, current_tp_group
from shared.runtime.forward_context import set_forward_context

if TYPE_CHECKING:
    from policy.config import EngineConfig

logger = logging.getLogger("runnerlab")

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# KV memory the CPU default may take when no num_gpu_blocks_override is given.
_CPU_KV_BUDGET_BYTES = 2 * 1024**3


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class ModelExecutor:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        # The tensor-parallel group this executor's model is built for: the group in force
        # where the runner is constructed (SINGLE outside `building_for`). A draft
        # executor built next to it picks up the same one.
        self.tp_group = current_tp_group()
        mc = config.model_config
        self.dtype = torch_dtype(mc.dtype)
        self.block_size = config.cache_config.block_size
        self.model: torch.nn.Module | None = None
        # What forward() calls: the model, or V1's CUDA-graph wrapper around it.
        self.model_call: Any = None
        self.attn_layers: dict[str, Any] = {}
        self.layer_names: list[str] = []
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        # Memory other engines of this process already hold (runnerlab ab keeps two):
        # this engine sizes its KV cache from its own usage, not theirs.
        self._mem_baseline = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        self.backend = get_attn_backend(config.attention_backend, device)
        self.builder = self.backend.make_builder(device)

    # ---- model --------------------------------------------------------------------
    def load_model(self) -> None:
        from shared.model.loader import load_model

        mc = self.config.model_config
        source = self.config.load_config.weight_source  # "random" | "gguf" | "safetensors"
        start = time.perf_counter()
        with building_for(self.tp_group):  # this rank's shard of every parallel layer
            self.model = load_model(
                mc.hf_config,
                load_format="dummy" if source == "random" else "auto",
                model_dir=mc.model_dir if source == "safetensors" else None,
                gguf_path=mc.gguf_path if source == "gguf" else None,
                dtype=self.dtype,
                device=self.device,
                seed=self.config.load_config.seed,
            )
        self.attn_layers = dict(self.model.attention_layers())
        self.layer_names = list(self.attn_layers)
        for layer in self.attn_layers.values():
            layer.bind_backend(self.backend)
        nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tp = self.tp_group
        logger.info(
            "Loaded %s (%s, %s weights) in %.2f s: %.1f MB%s",
            mc.architecture, mc.dtype, source,
            time.perf_counter() - start, nbytes / 1e6,
            f" (tensor-parallel rank {tp.rank} of {tp.world_size})" if tp.distributed else "",
        )

    def weight_bytes(self, include_embedding: bool = False) -> int:
        """Bytes of weights a decode step reads on this rank (its shards: the local
        parameters): everything but the input embedding (a step gathers a few rows of it),
        unless the embedding is tied to the LM head, which reads all of it."""
        tied = bool(getattr(self.model, "tie_word_embeddings", False))
        total = 0
        for name, p in self.model.named_parameters():
            if not include_embedding and not tied and "embed_tokens" in name:
                continue
            total += p.numel() * p.element_size()
        return total

    # ---- KV cache -------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """This rank's KV bytes per block (after load_model): its attention layers' local
        KV heads, not the model config's total."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * self.block_size * layer.num_kv_heads * layer.head_dim * elem
                   for layer in self.attn_layers.values())

    def determine_num_blocks(self, profile_fn, extra_bytes_per_block: int = 0) -> int:
        """From num_gpu_blocks_override, else from free memory on GPU (after a profile
        forward of the largest batch), else a CPU default bounded by a fixed budget.
        extra_bytes_per_block: KV that shares the block layout (a draft model's)."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        per_block = self.kv_bytes_per_block() + extra_bytes_per_block
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            profile_fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - self._mem_baseline
            free, total = torch.cuda.mem_get_info()
            used_by_others = total - free - torch.cuda.memory_reserved()
            budget = total * cc.gpu_memory_utilization - peak - max(used_by_others, 0)
            num_blocks = int(budget // per_block)
            logger.info(
                "KV cache sizing: total %.1f GB x %.2f, peak activations+weights %.1f GB -> "
                "%d blocks (%.1f GB)", total / 1e9, cc.gpu_memory_utilization, peak / 1e9,
                num_blocks, num_blocks * per_block / 1e9,
            )
            return num_blocks
        sc = self.config.scheduler_config
        blocks_per_seq = -(-sc.max_model_len // self.block_size)
        wanted = blocks_per_seq * max(4, min(sc.max_num_seqs, 64))
        return max(1, min(wanted, _CPU_KV_BUDGET_BYTES // per_block))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.attn_layers.values():
            # the layer's own (local) KV heads: a tensor-parallel rank caches only its heads
            shape = self.backend.kv_cache_shape(
                num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.bind_kv_cache(kv)
            self.kv_caches.append(kv)
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks x %d tokens, %d layers, %.1f MB",
            num_blocks, self.block_size, len(self.kv_caches),
            num_blocks * self.kv_bytes_per_block() / 1e6,
        )

    # ---- one forward ----------------------------------------------------------------
    def build_attn_metadata(self, common: CommonAttentionMetadata | None) -> Any:
        """The backend's builder runs once per step; layers share the result."""
        return None if common is None else self.builder.build(common)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: Any,
        num_tokens: int,
        cudagraph_mode: str = "NONE",
        batch_descriptor: Any = None,
        run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One forward under the step's forward context. `run` replaces the model call
        for this forward: V2's explicit piecewise replay, whose eager attention calls
        read the context like the model's own."""
        with set_forward_context(
            attn_metadata, self.layer_names, num_tokens, cudagraph_mode, batch_descriptor
        ):
            return (run or self.model_call or self.model)(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)


def rows_at_logits(x: torch.Tensor, logits_indices: torch.Tensor, num_reqs: int,
                   num_tokens: int) -> torch.Tensor:
    """The rows of x (hidden states or positions, by token) at each request's last token.
    When every request schedules exactly one token (num_tokens == num_reqs: a decode
    step), those are rows 0..num_reqs-1 and a view serves, without a gather launch; a
    step's host time counts every launch (issue 21). Rows past num_reqs are padding."""
    if num_tokens == num_reqs:
        return x[:num_reqs]
    return x.index_select(0, logits_indices)
