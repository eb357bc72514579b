"""TRITON backend: the unified paged-attention kernel (the GPU default).

Which launches run is decided from host values only, so it never needs a device sync:
- the single-query (split-KV decode) mapping runs when max_query_len <= 1 or
  num_decodes > 0; it owns every row with query length 1;
- the multi-query (tiled prefill) mapping runs when max_query_len > 1; it owns the rows
  with query length > 1, and the length-1 rows too when the single-query mapping is off.
Each row is therefore handled by exactly one mapping whatever num_decodes says.
- Except: a uniform batch whose every real row has the same short query length q > 1
  (a speculative verify of 1 + k tokens a request; uniform_query_len, set in build())
  runs the split mapping alone over rows of q tokens, where q x GROUP heads fit one
  program's tile (splits_query_rows): the multi-query mapping gives such a batch one
  program per (request, KV head), which left a batch-1 verify at 1024 keys latency-bound
  on a handful of SMs (docs/results/raw/a5e84ee/h100_profile_spec_before.log).

CUDA-graph rule: a uniform-decode batch (max_query_len == 1) always launches exactly the
single-query program (+ its split reduction), with a grid fixed by the padded row count
and a split count that is a function of that row count and the device alone. So a graph
captured on one uniform-decode batch replays correctly for any seq_lens, block tables or
number of real rows within the captured size. The same holds for a uniform verify batch:
its query length is the graph's (the batch descriptor's), padded rows have length 0.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from shared.attention.backend import AttentionBackend
from shared.attention.decode_attention import decode_attention
from shared.attention.metadata import CommonAttentionMetadata
from shared.attention.triton_unified_attention import PagedAttentionPlan, splits_query_rows
from shared.runtime.kernel_options import kernel_options
from shared.runtime.triton_utils import next_power_of_2

# Upper bound on KV splits per (request, kv head): 64 splits x 512 keys covers 32k.
DEFAULT_MAX_NUM_SPLITS = 64
# When a uniform-decode batch writes its K/V inside the decode attention kernel instead
# of in a KV-write kernel before it (KernelOptions.fused_decode_kv_write): "auto" when its
# (row, KV head) pairs number fewer than the GPU's SMs, where the step is bound by latency
# and the fusion pays (llama-3-8b batch 1 on the H200); with more rows the two-kernel path
# measured faster (qwen3-0.6b batch 64-512; both in
# docs/results/raw/41682bd/h200_decode_fused_kv_final.json). "always" / "never":
# benchmarks, tests.


@dataclass
class TritonAttentionMetadata:
    common: CommonAttentionMetadata  # the layer reads slot_mapping from here
    query_start_loc: torch.Tensor  # int32 [R + 1], device
    seq_lens: torch.Tensor  # int32 [R], device; 0 on padded rows
    block_table: torch.Tensor  # int32 [R, max_blocks_per_req], device
    run_single_query: bool
    run_multi_query: bool
    # q when every real row has exactly q query tokens (num_actual_tokens equals
    # num_reqs x max_query_len, an upper bound at worst), else 0
    uniform_query_len: int
    # The step's paged-attention launch plans, one per attention shape, built by the
    # first layer that needs one (TritonAttentionImpl.forward); see PagedAttentionPlan.
    plans: dict = field(default_factory=dict)


class TritonMetadataBuilder:
    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        for name in ("query_start_loc", "seq_lens", "block_table"):
            t = getattr(common, name)
            assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
        # No .contiguous() copy here: a graph must read the persistent table itself.
        assert common.block_table.stride(-1) == 1, "block_table rows must be contiguous"
        uniform_decode = common.max_query_len <= 1
        uniform = common.num_reqs > 0 and (
            common.num_actual_tokens == common.num_reqs * common.max_query_len)
        return TritonAttentionMetadata(
            common=common,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table,
            run_single_query=uniform_decode or common.num_decodes > 0,
            run_multi_query=not uniform_decode,
            uniform_query_len=common.max_query_len if uniform else 0,
        )


def num_splits_for(num_reqs_padded: int, num_kv_heads: int, num_sms: int, max_splits: int) -> int:
    """How many KV splits the single-query grid gets: enough programs to fill the GPU
    about four times over. A pure function of padded sizes and the device, so a graph
    captured at one padded batch size keeps it on every replay."""
    programs = num_reqs_padded * num_kv_heads
    target = 4 * num_sms
    if programs >= target:
        return 1
    return max(1, min(next_power_of_2(math.ceil(target / programs)), max_splits))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        # Interpreter: programs run one after another, splitting only adds work.
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonAttentionImpl:
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        num_splits: int | None = None,
        max_num_splits: int = DEFAULT_MAX_NUM_SPLITS,
    ):
        assert num_heads % num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.num_splits = num_splits  # None: chosen from the padded row count
        self.max_num_splits = max_num_splits

    def splits_for(self, num_reqs_padded: int, device: torch.device,
                   max_keys: int = 0) -> int:
        """KV splits of the single-query grid. max_keys: the most keys a row can have
        (its block-table width in keys), which batch-invariant mode's split grid covers."""
        if kernel_options().batch_invariant:
            return self._invariant_splits(num_reqs_padded, device, max_keys)
        forced = self.num_splits or kernel_options().attention_num_splits
        if forced is not None:
            return forced
        split_tokens = kernel_options().attention_split_tokens
        if split_tokens is not None and max_keys > 0:
            return math.ceil(max_keys / split_tokens)
        return num_splits_for(
            num_reqs_padded, self.num_kv_heads, _num_sms(device), self.max_num_splits
        )

    def _invariant_splits(self, num_reqs_padded: int, device: torch.device,
                          max_keys: int) -> int:
        # A row's splits sit at fixed key positions (KernelOptions.invariant_split_tokens)
        # whatever the grid, and are folded in one order (fold_partial), so only the grid
        # may follow the batch: where the rows' programs leave SMs without a program
        # (batch 1 of llama-3-8b: 8 programs) each split gets a program, enough of them
        # for the longest row the block table holds, most of which exit at once on short
        # rows; otherwise each program runs its row's splits one after another (a
        # grid of (row, head, split) programs as wide as the table costs its exits).
        if num_reqs_padded * self.num_kv_heads >= _num_sms(device) or max_keys <= 0:
            return 1
        return math.ceil(max_keys / kernel_options().invariant_split_tokens)

    def fuses_kv_write(self, metadata: TritonAttentionMetadata) -> bool:
        """Does forward_with_kv_write do this step's KV write and attention in one kernel
        (see decode_attention)? Uniform decode only (no multi-query launch), and then as
        KernelOptions.fused_decode_kv_write says."""
        setting = kernel_options().fused_decode_kv_write
        # Batch-invariant mode: never (the fused kernel is a separate attention code path,
        # which a prefill row does not take).
        if metadata.run_multi_query or setting == "never" or kernel_options().batch_invariant:
            return False
        if setting == "always":
            return True
        num_reqs_padded = metadata.seq_lens.shape[0]  # a graph's fixed size: no sync
        return num_reqs_padded * self.num_kv_heads < _num_sms(metadata.seq_lens.device)

    def forward_with_kv_write(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        output: torch.Tensor,
    ) -> None:
        assert self.fuses_kv_write(metadata)
        decode_attention(
            query, key, value, key_cache, value_cache, output,
            metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
            metadata.common.slot_mapping, self.scale,
            num_splits=self.splits_for(metadata.seq_lens.shape[0], query.device),
        )

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: TritonAttentionMetadata,
        output: torch.Tensor,  # [T, H, D]
    ) -> None:
        # Layers of one shape share a plan: the first builds it (split count, configs,
        # grids, partials), the others only launch.
        key = (self.num_heads, self.num_kv_heads, self.head_dim, self.scale)
        plan = metadata.plans.get(key)
        if plan is None:
            single, multi, query_len = (
                metadata.run_single_query, metadata.run_multi_query, 1)
            if splits_query_rows(metadata.uniform_query_len,
                                 self.num_heads // self.num_kv_heads,
                                 wide=query.element_size() >= 4):
                single, multi, query_len = True, False, metadata.uniform_query_len
            plan = metadata.plans[key] = PagedAttentionPlan.build(
                query, key_cache, value_cache, output,
                metadata.query_start_loc, metadata.seq_lens, metadata.block_table, self.scale,
                run_single_query=single, run_multi_query=multi,
                num_splits=self.splits_for(
                    metadata.seq_lens.shape[0], query.device,
                    max_keys=metadata.block_table.shape[1] * key_cache.shape[1]),
                split_query_len=query_len,
            )
        plan.launch(query, key_cache, value_cache, output)


class TritonBackend(AttentionBackend):
    name = "TRITON"
    supports_full_cudagraph = True

    def __init__(
        self, num_splits: int | None = None, max_num_splits: int = DEFAULT_MAX_NUM_SPLITS
    ):
        # num_splits forces the decode split count (tests); None = from the padded batch.
        self.num_splits = num_splits
        self.max_num_splits = max_num_splits

    def make_builder(self, device: torch.device) -> TritonMetadataBuilder:
        return TritonMetadataBuilder()

    def make_impl(self, num_heads, head_dim, num_kv_heads, scale) -> TritonAttentionImpl:
        return TritonAttentionImpl(
            num_heads, head_dim, num_kv_heads, scale, self.num_splits, self.max_num_splits
        )
