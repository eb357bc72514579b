"""ModelExecutor under tensor parallelism (no processes: a TPGroup without process groups
builds and loads rank r's model): the executor keeps the group in force at construction,
as a draft executor built next to it does, builds its model for it, and sizes the KV cache
and the weight bytes from this rank's layers (its KV heads, its shards), not from the
model config's totals."""

from __future__ import annotations

import torch

from policy.engine_args import EngineArgs
from shared.distributed.group import SINGLE, TPGroup, building_for, current_tp_group
from shared.runtime.draft_executor import make_draft_executor
from shared.runtime.model_executor import ModelExecutor

BLOCK_SIZE = 16


def _executor(group: TPGroup):
    config = EngineArgs(model="tiny-llama", device="cpu", dtype="float32",
                        block_size=BLOCK_SIZE).create_engine_config()
    with building_for(group):
        executor = ModelExecutor(config, torch.device("cpu"))
        draft = make_draft_executor(config, config.model_config, torch.device("cpu"))
    assert current_tp_group() is SINGLE
    executor.load_model()  # outside the context: the executor's own group counts
    return executor, draft, config.model_config


def test_rank_executor_sizes_its_own_shard():
    group = TPGroup(rank=3, world_size=4)
    executor, draft, mc = _executor(group)
    assert executor.tp_group is group and draft.tp_group is group
    assert mc.num_kv_heads == 2 and mc.num_hidden_layers == 2  # 2 KV heads over 4 ranks: 1 each
    layers = list(executor.attn_layers.values())
    assert [(a.num_heads, a.num_kv_heads) for a in layers] == [(1, 1)] * 2
    assert executor.kv_bytes_per_block() == 2 * BLOCK_SIZE * 1 * mc.head_dim * 4 * 2
    executor.initialize_kv_cache(3)
    assert [tuple(kv.shape) for kv in executor.kv_caches] == [(2, 3, BLOCK_SIZE, 1, mc.head_dim)] * 2
    # hidden 64, head_dim 16, intermediate 128, vocab 512; per rank and layer: q 1 head +
    # k, v 1 head each, o_proj 16 input columns, gate|up 2 x 32 rows, down 32 columns, two
    # norms; then the embedding and the LM head, 128 vocab rows each, and the final norm
    per_layer = 3 * 16 * 64 + 64 * 16 + 2 * 32 * 64 + 64 * 32 + 2 * 64
    local = 2 * per_layer + 2 * 128 * 64 + 64
    assert executor.weight_bytes(include_embedding=True) == 4 * local
    assert executor.weight_bytes() == 4 * (local - 128 * 64)  # the input embedding left out
    whole, _, _ = _executor(SINGLE)
    assert whole.kv_bytes_per_block() == 2 * executor.kv_bytes_per_block()  # 2 heads vs 1
