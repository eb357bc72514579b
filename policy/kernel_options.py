"""KernelOptions: how the CUDA kernels are chosen and launched, one frozen record per engine.

Every option that used to be a module-level switch of a kernel file lives here, so two
engines in one process (`runnerlab ab` holds two) can differ, a benchmark builds an
engine with the options it measures instead of patching modules, and a captured CUDA
graph holds exactly the options of the engine that captured it. The engine installs its
options around each of its steps and its set-up (shared.runtime.kernel_options); the
kernel launchers read them there. The defaults are the shipped configuration: the H200
results in docs/results/ were measured with them.

Options that only benchmarks and kernel tests change are marked so; they exist to price
one part of a step, not to tune a deployment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# The widest KV tile of the attention kernels (16-bit inputs up to head_dim 128); the
# others (32, 16) divide it, so a split of a multiple of it is whole tiles on every path.
_WIDEST_KV_TILE = 64


class KernelOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    fused_ops: bool = Field(
        True, description="Triton RMSNorm / SiLU-and-mul / q-k norm + RoPE on CUDA; "
                          "False: the PyTorch ops")
    gemv: bool = Field(
        True, description="the fused batch-1 GEMVs on CUDA; False: cuBLAS + separate kernels")
    gemv_max_tokens: int = Field(
        1, ge=0, description="token rows up to which a linear layer takes the GEMV path")
    gemv_configs: dict[str, tuple[int, ...]] = Field(
        default_factory=dict,
        description="launch configs by shape key, over the device's table (benchmarks, tuners)")
    pdl: bool = Field(True, description="programmatic dependent launch (sm_90+)")
    fused_decode_kv_write: Literal["auto", "always", "never"] = Field(
        "auto", description="the decode attention writes the step's K/V itself: auto (the "
                            "backend's rule), always, or never (a KV-write kernel first)")
    decode_attention_preload: bool | None = Field(
        None, description="the decode attention loads its first KV tile before the PDL "
                          "wait; None: when the launch splits the KV (benchmarks)")
    decode_attention_num_stages: int = Field(
        1, ge=1, description="software-pipeline stages of the decode attention (benchmarks)")
    attention_min_tiles_per_split: int = Field(
        1, ge=1, description="fewest KV tiles a split of the unified attention takes (benchmarks)")
    attention_tile_n: int | None = Field(
        None, ge=16, description="KV tile of the single-query attention; None: by head size "
                                 "(benchmarks)")
    attention_num_warps: int | None = Field(
        None, ge=1, description="warps of the single-query attention; None: 4 (benchmarks)")
    attention_num_splits: int | None = Field(
        None, ge=1, description="KV splits of every decode launch; None: by batch and SM "
                                "count (benchmarks)")
    attention_split_tokens: int | None = Field(
        None, ge=64, description="the unified attention's decode launches (not the fused "
                                 "decode + KV-write kernel) cut a row's KV into splits of "
                                 "this many keys (a multiple of 64), a grid covering the "
                                 "longest row, instead of a split count by batch and SM "
                                 "count (benchmarks: balance on ragged contexts)")
    repeat_launches: bool = Field(
        True, description="a kernel launched once per layer with the same arguments but "
                          "the layer's tensors (the eager attention of a piecewise step) "
                          "launches its compiled kernel directly after the first layer "
                          "(shared/runtime/triton_launch.py), and a per-step kernel (V2's input "
                          "prep, sampler, post-update; the shared noise) its compiled kernel per "
                          "grid; False: Triton's dispatch every time (benchmarks: "
                          "docs/results/README.md, mixed steps and the sample stage's host time)")
    nvtx: bool = Field(False, description="NVTX ranges around each runner stage")
    batch_invariant: bool = Field(
        False, description="every kernel on the step's path computes a row with a reduction "
                           "order that does not depend on the batch: the fixed-tile matmul "
                           "for every linear layer (no GEMV, no cuBLAS), fixed-size KV splits "
                           "and one launch config for both attention mappings (policy/"
                           "batch_invariance.py; EngineArgs.batch_invariant sets it)")
    invariant_split_tokens: int = Field(
        256, ge=64, description="batch-invariant mode: a row's KV is cut into splits of this "
                                "many keys (a multiple of the attention's KV tile) at fixed "
                                "positions, whatever the batch; the splits run in parallel "
                                "where the batch leaves the GPU idle and are merged in one "
                                "order everywhere")
    draft_full_graphs: bool = Field(
        True, description="a draft model's uniform forwards (every request the same query "
                          "length: its single-token drafts, a uniform catch-up) replay FULL "
                          "CUDA graphs where the engine's cudagraph_mode has FULL graphs; "
                          "False: the draft's piecewise graphs only (benchmarks)")

    @model_validator(mode="after")
    def _splits_are_whole_tiles(self) -> KernelOptions:
        # Checked here, not at the first attention launch: a bad value would otherwise
        # fail inside a step. A split is whole KV tiles of every attention path.
        tile = max(_WIDEST_KV_TILE, self.attention_tile_n or 0)
        for name in ("invariant_split_tokens", "attention_split_tokens"):
            value = getattr(self, name)
            if value is not None and value % tile:
                raise ValueError(
                    f"KernelOptions.{name}={value} is not a multiple of {tile}, the widest "
                    f"KV tile of the attention kernels (attention_tile_n={self.attention_tile_n}); "
                    f"accepted: a multiple of {tile}, e.g. {max(tile, value - value % tile)}")
        return self

    def gemv_config(self, key: str) -> tuple[int, ...] | None:
        return self.gemv_configs.get(key)
