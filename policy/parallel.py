"""Tensor-parallel settings checked at config time: the sizes a model can be split into,
the devices a launch has, and how long rank 0 waits for its workers.

How a size that does not fit is handled (the model layers apply the same rules):
- attention heads must split evenly: refused otherwise;
- KV heads split evenly when there are at least as many as ranks; with fewer, each KV head
  is replicated on tensor_parallel_size / num_kv_heads ranks (which must be whole);
- the MLP's (and each expert's) intermediate size must split evenly: refused otherwise;
- the vocabulary is padded up to a multiple of the size: each rank holds ceil(V / N) rows
  of the embedding and the LM head, padded rows are zero, never looked up, and the
  gathered logits are trimmed back to V columns. So any vocabulary size works.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict

from policy.errors import field_error as _fail

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ParallelConfig(BaseModel):
    model_config = ConfigDict(frozen=True)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # How long rank 0 waits on a collective or a worker before it raises (a dead or hung
    # worker must not hang the engine).
    distributed_timeout_s: float = 120.0

    @property
    def distributed(self) -> bool:
        return self.tensor_parallel_size > 1


def _sizes_to_split(model: Any) -> list[tuple[str, int]]:
    """(config field, size) of every dimension tensor parallelism splits evenly."""
    cfg = model.hf_config
    sizes = [("num_attention_heads", model.num_attention_heads),
             ("intermediate_size", model.intermediate_size)]
    for field in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(cfg, field, None) if cfg is not None else None
        if value:
            sizes.append((field, int(value)))
    return [(f, v) for f, v in sizes if v]


def check_model_split(tp: int, model: Any) -> None:
    """Refuse a tensor_parallel_size the model cannot be split into (see the module doc)."""
    if tp == 1:
        return
    for field, size in _sizes_to_split(model):
        if size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the model's {field} ({size}); "
                f"choose a tensor_parallel_size that divides {size}")
    kv = model.num_kv_heads
    if kv and kv % tp and tp % kv:
        raise ValueError(
            f"tensor_parallel_size={tp} and num_key_value_heads={kv}: the KV heads can neither "
            f"be split evenly nor replicated evenly; choose a tensor_parallel_size that divides "
            f"{kv} or is a multiple of it")


def torchrun_world() -> tuple[int, int, int] | None:
    """(rank, world_size, local_world_size) when launched by torchrun, else None."""
    if not all(name in os.environ for name in TORCHRUN_ENV):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def check_launch(tp: int, device: str, *, visible_devices: int | None) -> None:
    """Refuse a launch that cannot place its ranks: under torchrun the world must be the
    tensor-parallel group; on CUDA each local rank needs its own GPU."""
    launched = torchrun_world()
    if launched is not None and launched[1] != tp:
        raise ValueError(
            f"tensor_parallel_size={tp} but torchrun started WORLD_SIZE={launched[1]} ranks; "
            f"launch with --nproc-per-node {tp} (one rank per tensor-parallel shard)")
    if device != "cuda" or tp == 1 or visible_devices is None:
        return
    local = tp if launched is None else launched[2]
    if local > visible_devices:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ValueError(
            f"tensor_parallel_size={tp} needs {local} GPUs on this host but {visible_devices} "
            f"are visible (CUDA_VISIBLE_DEVICES={shown}); lower tensor_parallel_size or make "
            "more GPUs visible")


def resolve_parallel(tensor_parallel_size: int, pipeline_parallel_size: int, *,
                     model: Any = None, device: str = "cpu",
                     visible_devices: int | None = None,
                     distributed_timeout_s: float = 120.0) -> ParallelConfig:
    # Pipeline sizes above 1 are a feature in the table (refused through the gate, with a
    # message naming the field); sizes below 1 are plain mistakes.
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size)):
        if value < 1:
            raise _fail(name, value, "an integer >= 1")
    if not distributed_timeout_s > 0:
        raise _fail("distributed_timeout_s", distributed_timeout_s, "a number of seconds > 0")
    if model is not None and model.num_attention_heads is not None:
        check_model_split(tensor_parallel_size, model)
    check_launch(tensor_parallel_size, device, visible_devices=visible_devices)
    return ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                          pipeline_parallel_size=pipeline_parallel_size,
                          distributed_timeout_s=distributed_timeout_s)
