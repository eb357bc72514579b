"""Host side of the unified paged attention: per-mapping launch configurations and the
`paged_attention` launcher. The kernels, and the layout and program mappings they
implement, are in unified_attention_kernels.

Both grids depend only on padded sizes (T, R) and the split count, never on per-step
values, and nothing here reads a device value on the host: a CUDA graph can capture it.
Padded rows (query length 0, seq_len 0) and padded tokens are never written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.attention.unified_attention_kernels import (
    paged_attention_kernel,
    reduce_splits_kernel,
)
from shared.runtime.kernel_options import kernel_options
from shared.runtime.triton_launch import RepeatLaunch
from shared.runtime.triton_utils import INTERPRET, next_power_of_2, pdl_launch, tl

LOG2E = 1.4426950408889634

# The engine's KernelOptions set three launch parameters here, read at each launch:
# - attention_min_tiles_per_split (default 1): a split covers at least this many KV tiles.
#   One: at batch 1 the decode is bound by latency, and one tile per split means the
#   uniform-decode kernel has its whole range loaded before its PDL wait (llama-3-8b
#   batch 1 on the H200: faster than two, row v1-attnmin2 of
#   docs/results/raw/d4e2408/h200_decode_llama3_8b_d4e2408.json). A partial costs 1/16 of a 64-key
#   tile's reads per head.
# - attention_tile_n: keys per loop iteration of the decode (single-query) kernel for
#   16-bit inputs; None: 64 up to head_dim 128, else 32.
# - attention_num_warps: warps of that kernel for 16-bit inputs; None: 4.


def min_tiles_per_split() -> int:
    return kernel_options().attention_min_tiles_per_split


@dataclass(frozen=True)
class _KernelConfig:
    block_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int


def invariant_config(group: int, block_d: int, wide: bool) -> _KernelConfig:
    """Batch-invariant mode: ONE config for both mappings, so a token's row sees the same
    dot shapes, KV tiles (aligned to absolute key positions in either mapping) and online
    softmax whether it is a decode row or a row of a prefill chunk. A fully masked extra
    tile of the multi-query mapping leaves a row's running max, sum and output exactly as
    they were (alpha = exp2(0) = 1, p = 0), so the tile count a program loops over does
    not matter. BLOCK_M 16 (the fewest rows tl.dot takes): a decode row's GROUP heads fill
    it without the 8x idle MMA rows the multi-query config's 128 would cost at batch 256."""
    block_m = max(16, next_power_of_2(group))
    if wide:
        return _KernelConfig(block_m, block_m // group, 16, num_warps=4, num_stages=2)
    tile_n = 64 if block_d <= 128 else 32
    return _KernelConfig(block_m, block_m // group, tile_n, num_warps=4, num_stages=2)


def fixed_split_tokens() -> int | None:
    """Keys per KV split where splits have a fixed size: batch-invariant mode's
    invariant_split_tokens, else attention_split_tokens (None: a split count)."""
    options = kernel_options()
    if options.batch_invariant:
        return options.invariant_split_tokens
    return options.attention_split_tokens


def split_tiles_of(tokens: int, tile_n: int) -> int:
    """A fixed split of `tokens` keys in tiles of `tile_n` keys. KernelOptions refuses a
    split that is not a multiple of the widest tile, which every tile divides."""
    assert tokens % tile_n == 0, (tokens, tile_n)
    return tokens // tile_n


def single_query_config(group: int, block_d: int, wide: bool,
                        query_len: int = 1) -> _KernelConfig:
    """The split mapping's config for rows of `query_len` tokens (1: decodes)."""
    # tl.dot needs M >= 16: the GROUP heads of one decode token fill the rows (the rest
    # are masked). Decode is bandwidth-bound, so the idle rows cost nothing that matters;
    # a short verify row's tokens fill them instead (4 tokens x GROUP 4: no idle row).
    if kernel_options().batch_invariant:
        assert query_len == 1, "batch-invariant mode splits no multi-token row"
        return invariant_config(group, block_d, wide)
    block_m = max(16, next_power_of_2(group * query_len))
    if wide:  # see _multi_query_config
        return _KernelConfig(block_m, query_len, 32, num_warps=8, num_stages=3)
    options = kernel_options()
    tile_n = options.attention_tile_n or (64 if block_d <= 128 else 32)
    return _KernelConfig(block_m, query_len, tile_n,
                         num_warps=options.attention_num_warps or 4, num_stages=3)


# The split mapping takes a uniform batch's rows of several tokens (a speculative verify)
# while their tokens x GROUP heads fit this many rows of one program's tile; longer rows
# go to the multi-query mapping, which does not split the KV. Wide (fp32 / fp64) inputs:
# the multi-query mapping's own row limit (see _multi_query_config).
MAX_SPLIT_ROWS = 64
MAX_SPLIT_ROWS_WIDE = 32


def splits_query_rows(query_len: int, group: int, wide: bool) -> bool:
    """Does the split mapping take a uniform batch whose rows have `query_len` tokens?"""
    limit = MAX_SPLIT_ROWS_WIDE if wide else MAX_SPLIT_ROWS
    return (1 < query_len and next_power_of_2(query_len * group) <= limit
            and not kernel_options().batch_invariant)


def _multi_query_config(group: int, block_d: int, wide: bool) -> _KernelConfig:
    """wide: fp32/fp64 inputs, whose exact ("ieee") dot runs on CUDA cores with operands
    in registers; larger tiles than these spill heavily at head_dim 128 (checked by
    compiling for sm_90)."""
    if kernel_options().batch_invariant:
        return invariant_config(group, block_d, wide)
    if wide:
        block_m, tile_n, num_warps = max(32, next_power_of_2(group)), 16, 4
    else:
        block_m = max(128 if block_d <= 128 else 64, next_power_of_2(group))
        tile_n, num_warps = 64, 8 if block_d >= 128 else 4
    return _KernelConfig(block_m, block_m // group, tile_n, num_warps=num_warps, num_stages=2)


def dot_dtype_for(dtype: torch.dtype):
    """The dtype tl.dot sees. bf16 arithmetic is garbage under the interpreter, so there
    bf16 is upcast to fp32 (on a GPU it stays bf16 and runs on tensor cores)."""
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRET else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32, torch.float64: tl.float64}[
        dtype
    ]


def dot_precision_for(dot_dtype) -> str:
    # fp32/fp64 inputs: exact products (no tf32), so results track the oracle.
    return "ieee" if dot_dtype in (tl.float32, tl.float64) else "tf32"


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    output: torch.Tensor,  # [T, H, D]; rows of padded tokens are left untouched
    query_start_loc: torch.Tensor,  # int32 [R + 1]
    seq_lens: torch.Tensor,  # int32 [R]
    block_table: torch.Tensor,  # int32 [R, max_blocks_per_req]
    scale: float,
    run_single_query: bool,
    run_multi_query: bool,
    num_splits: int = 1,
    split_query_len: int = 1,
) -> None:
    """Launch the unified kernel in the mappings asked for.

    run_single_query: rows with query length `split_query_len` (1: decodes; more: every
    row of a uniform verify batch) go to the split-KV mapping.
    run_multi_query: rows with query length > 1 (and, when run_single_query is False,
    also those of length 1) go to the tiled multi-query mapping; with a split_query_len
    above 1 it must be off. Launch shapes depend only on T, R, the head shape, num_splits
    and split_query_len.
    """
    plan = PagedAttentionPlan.build(
        query, key_cache, value_cache, output, query_start_loc, seq_lens, block_table, scale,
        run_single_query, run_multi_query, num_splits, split_query_len)
    plan.launch(query, key_cache, value_cache, output)


@dataclass(frozen=True)
class PagedAttentionPlan:
    """One step's paged-attention launches minus the layer's own tensors: grids, launch
    arguments, split partials. Every layer of a step launches the same shapes over the
    same metadata, so the backend builds this once per step (TritonAttentionImpl keeps
    it on the step's metadata) and each layer pays only its launches: on a model of
    many thin layers the set-up, repeated per layer, cost about as much as the launches
    (scripts/bench_attention_host.py). The partials are shared by the layers: a layer's
    split kernel and reduction are done before the next layer's start (one stream), also
    inside a captured graph, where they come from the graph's pool.
    """

    signature: tuple  # query shape and the four tensors' strides it was built for
    metadata: tuple  # block_table, seq_lens, query_start_loc
    partials: tuple  # part_out, part_max, part_sum (placeholders with one split)
    runtime: tuple  # qk_scale, num_reqs, strides
    # The launches (RepeatLaunch: after the first layer's, each launches the compiled
    # kernel without Triton's per-call dispatch) or None where the mapping does not run.
    single: RepeatLaunch | None  # the single-query mapping
    multi: RepeatLaunch | None  # the multi-query mapping
    reduce: RepeatLaunch | None  # the split reduction

    @staticmethod
    def signature_of(query, key_cache, value_cache, output) -> tuple:
        return (query.shape, query.stride(), key_cache.shape, key_cache.stride(),
                value_cache.stride(), output.stride())

    @classmethod
    def build(cls, query, key_cache, value_cache, output, query_start_loc, seq_lens,
              block_table, scale: float, run_single_query: bool, run_multi_query: bool,
              num_splits: int, split_query_len: int = 1) -> PagedAttentionPlan:
        num_tokens, num_heads, head_dim = query.shape
        _, kv_block_size, num_kv_heads, _ = key_cache.shape
        num_reqs = seq_lens.shape[0]
        check_launch(query, key_cache, value_cache, output, query_start_loc, seq_lens,
                     block_table, num_splits)
        if num_tokens == 0 or num_reqs == 0:
            run_single_query = run_multi_query = False
        # The multi-query mapping skips only length-1 rows: a split mapping of longer
        # rows would leave it the same rows a second time.
        assert split_query_len == 1 or not run_multi_query, split_query_len
        group = num_heads // num_kv_heads
        block_d = max(16, next_power_of_2(head_dim))
        dot_dtype = dot_dtype_for(query.dtype)
        wide = query.element_size() >= 4
        consts = dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, KV_BLOCK_SIZE=kv_block_size,
            MIN_TILES_PER_SPLIT=min_tiles_per_split(), DOT_DTYPE=dot_dtype,
            DOT_PRECISION=dot_precision_for(dot_dtype),
        )
        fold = {}
        split_tokens = fixed_split_tokens()
        if kernel_options().batch_invariant:
            # Splits at fixed key positions in both mappings: a split program covers
            # exactly one (num_splits covers the longest row: the backend's splits_for),
            # an unsplit program folds its row's splits itself, in the reduction's order.
            split_tiles = split_tiles_of(split_tokens,
                                         invariant_config(group, block_d, wide).tile_n)
            consts["MIN_TILES_PER_SPLIT"] = split_tiles
            fold = dict(FOLD_TILES=split_tiles)
        elif split_tokens is not None and run_single_query:
            # num_splits covers the longest row, so every split has exactly this size
            consts["MIN_TILES_PER_SPLIT"] = split_tiles_of(
                split_tokens, single_query_config(group, block_d, wide, split_query_len).tile_n)
        single = multi = reduce = None
        keep = kernel_options().repeat_launches
        partials = split_partials(query, num_reqs * split_query_len, num_splits) \
            if run_single_query else (query, query, query)
        if run_single_query:
            cfg = single_query_config(group, block_d, wide, split_query_len)
            single = RepeatLaunch(
                paged_attention_kernel, (num_reqs, num_kv_heads, num_splits), keep, **consts,
                BLOCK_M=cfg.block_m, BLOCK_Q=split_query_len, TILE_N=cfg.tile_n,
                SINGLE_QUERY=True, MIN_QUERY_LEN=1, NUM_SPLITS=num_splits,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(query),
                **fold)
            if num_splits > 1:
                reduce = RepeatLaunch(
                    reduce_splits_kernel, (num_reqs * split_query_len, num_heads), keep,
                    HEAD_DIM=head_dim, BLOCK_D=block_d, TILE_N=cfg.tile_n,
                    NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
                    MIN_TILES_PER_SPLIT=consts["MIN_TILES_PER_SPLIT"], num_warps=4,
                    QUERY_LEN=split_query_len, FOLD=bool(fold), **pdl_launch(output))
        if run_multi_query:
            cfg = _multi_query_config(group, block_d, wide)
            # When the single-query mapping also runs it owns the length-1 rows.
            grid = (num_tokens // cfg.block_q + num_reqs, num_kv_heads, 1)
            multi = RepeatLaunch(
                paged_attention_kernel, grid, keep,
                **consts, BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q, TILE_N=cfg.tile_n,
                SINGLE_QUERY=False, MIN_QUERY_LEN=2 if run_single_query else 1,
                NUM_SPLITS=1, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **fold)
        runtime = (scale * LOG2E, num_reqs, *output.stride(), *query.stride(),
                   *key_cache.stride(), *value_cache.stride(), block_table.stride(0))
        return cls(cls.signature_of(query, key_cache, value_cache, output),
                   (block_table, seq_lens, query_start_loc), partials, runtime, single, multi,
                   reduce)

    def launch(self, query, key_cache, value_cache, output) -> None:
        """The launches over one layer's tensors, which must have the plan's shapes and
        strides (the strides are launch arguments built into it)."""
        assert self.signature_of(query, key_cache, value_cache, output) == self.signature, (
            "a layer whose attention tensors differ in shape or layout from the plan's")
        head = (output, query, key_cache, value_cache, *self.metadata)
        if self.single is not None:
            self.single(*head, *self.partials, *self.runtime)
            if self.reduce is not None:
                block_table, seq_lens, query_start_loc = self.metadata
                self.reduce(output, *self.partials, seq_lens, query_start_loc, *output.stride())
        if self.multi is not None:
            self.multi(*head, output, output, output, *self.runtime)


def check_launch(query, key_cache, value_cache, output, query_start_loc, seq_lens,
                 block_table, num_splits: int) -> None:
    """The layout both attention launchers assume (module docstrings)."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    assert output.shape == query.shape and value_cache.shape == key_cache.shape
    assert key_cache.shape[3] == head_dim and num_heads % key_cache.shape[2] == 0
    assert query.dtype == key_cache.dtype == value_cache.dtype, (query.dtype, key_cache.dtype)
    assert query_start_loc.shape == (num_reqs + 1,) and block_table.shape[0] == num_reqs
    for t in (query_start_loc, seq_lens, block_table):
        assert t.dtype == torch.int32, t.dtype
    assert block_table.stride(1) == 1 and num_splits >= 1


def split_partials(query: torch.Tensor, num_rows: int, num_splits: int) -> tuple:
    """(part_out, part_max, part_sum) of a split launch over `num_rows` query tokens
    (padded rows x their query length). Allocated per call: under graph capture they come
    from the graph's pool, like any activation, so they stay valid for every replay. With
    one split the kernels never touch them (NUM_SPLITS == 1 compiles the partial stores
    away): placeholders."""
    if num_splits == 1:
        return query, query, query
    num_heads, head_dim = query.shape[1:]
    acc_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    part_out = query.new_empty((num_rows, num_heads, num_splits, head_dim), dtype=acc_dtype)
    part_max = query.new_empty((num_rows, num_heads, num_splits), dtype=acc_dtype)
    return part_out, part_max, torch.empty_like(part_max)


def reduce_splits(output: torch.Tensor, partials: tuple, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, tile_n: int, num_splits: int) -> None:
    """Merge the split partials of a decode launch with tiles of `tile_n` keys into the
    output rows (nothing to do with one split)."""
    if num_splits == 1:
        return
    head_dim = output.shape[2]
    reduce_splits_kernel[(seq_lens.shape[0], output.shape[1])](
        output, *partials, seq_lens, query_start_loc, *output.stride(),
        HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)), TILE_N=tile_n,
        NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
        MIN_TILES_PER_SPLIT=min_tiles_per_split(), num_warps=4, **pdl_launch(output),
    )
