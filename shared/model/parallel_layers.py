"""Tensor-parallel linear layers, the vocab-parallel embedding and the LM head.

Each layer reads its TPGroup from `current_tp_group()` at construction (the model is
built inside `building_for(group)`) and keeps it. Rank r of N holds:

- ColumnParallelLinear / MergedColumnParallelLinear: output rows [r*O/N, (r+1)*O/N) of
  each fused part (gate|up: rank r's gate rows, then its up rows). No collective: the
  output stays sharded (heads, or the MLP's intermediate features).
- QKVParallelLinear: q|k|v of its heads. KV heads are split like q when N divides
  num_kv_heads; when num_kv_heads < N (N a multiple of it) each rank holds one KV head,
  r * num_kv_heads // N: the head its q heads attend with (GQA groups never straddle).
- RowParallelLinear: input columns [r*I/N, (r+1)*I/N): a partial product, summed by
  `all_reduce`; the bias is added once, after the sum.
- VocabParallelEmbedding: rows [r*P, (r+1)*P), P = ceil(V / N) (the vocab padded to
  N*P; the padding rows are zero and never looked up). An id outside the rank's range
  gives a zero row; the all_reduce sums the one real row into every rank.
- ParallelLMHead: the rank's vocab rows give its logits; `all_gather` along the vocab,
  trimmed back to V, gives every rank the full logits.

With SINGLE (one process, no process groups) every layer computes exactly what the
single-GPU layer did (collectives are the identity; the row-parallel bias stays fused
into the matmul), with the same parameter names and shapes. Where each local parameter
sits in the logical one is its shard spec (shared/model/sharding.py); the loader and the
dummy init fill it from that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shared.distributed.group import TPGroup, current_tp_group
from shared.model.kernels import gemv
from shared.model.layers import Linear, linear
from shared.model.sharding import ShardSpec, set_shard_spec


def kv_heads_of_rank(tp: TPGroup, num_kv_heads: int) -> tuple[int, int]:
    """(KV heads this rank holds, the first one's index): split when N divides them,
    one replicated head when N is a multiple of them; else a clear error."""
    n = tp.world_size
    if num_kv_heads >= n and num_kv_heads % n == 0:
        local = num_kv_heads // n
        return local, tp.rank * local
    if num_kv_heads < n and n % num_kv_heads == 0:
        return 1, tp.rank * num_kv_heads // n
    raise ValueError(
        f"tensor_parallel_size={n} neither divides num_key_value_heads ({num_kv_heads}) "
        f"nor is a multiple of it; choose a tensor_parallel_size that divides "
        f"{num_kv_heads}, or a multiple of it that divides num_attention_heads")


class ColumnParallelLinear(Linear):
    """y = x W^T (+ b) with W's output rows split over the ranks; y stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 what: str = "out_features"):
        tp = current_tp_group()
        local = tp.shard(out_features, what)
        self._build(tp, in_features, [out_features], [(tp.rank * local, local)], bias)

    def _build(self, tp: TPGroup, in_features: int, output_sizes: list[int],
               picks: list[tuple[int, int]], bias: bool) -> None:
        """output_sizes: the logical fused parts; picks: (first row within the part, rows)
        this rank keeps of each part, in part order."""
        Linear.__init__(self, in_features, sum(n for _, n in picks), bias)
        self.tp_group = tp
        self.total_output_sizes = list(output_sizes)
        self.output_sizes = [n for _, n in picks]  # the local parts
        ranges, base = [], 0
        for size, (first, n) in zip(output_sizes, picks):
            ranges.append((base + first, base + first + n))
            base += size
        spec_rows = tuple(ranges)
        set_shard_spec(self.weight, ShardSpec((base, in_features), spec_rows, (0, in_features)))
        if self.bias is not None:
            set_shard_spec(self.bias, ShardSpec((base,), spec_rows, (0, 1)))

    def shard_rows(self, part: int) -> slice:
        """Rows of fused part `part` in the LOGICAL weight (and bias): what its checkpoint
        tensor fills. At world 1 they are the local rows too."""
        start = sum(self.total_output_sizes[:part])
        return slice(start, start + self.total_output_sizes[part])

    def local_rows(self, part: int) -> slice:
        """Rows of part `part` in this rank's weight."""
        start = sum(self.output_sizes[:part])
        return slice(start, start + self.output_sizes[part])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input in one matmul (gate|up), each part split
    over the ranks; checkpoints store the parts separately (`shard_rows`)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, *,
                 what: str = "output_sizes"):
        tp = current_tp_group()
        local = [tp.shard(size, what) for size in output_sizes]
        self._build(tp, in_features, list(output_sizes), [(tp.rank * n, n) for n in local], bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v of this rank's heads; `num_heads` / `num_kv_heads` are the local counts."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp = current_tp_group()
        local_heads = tp.shard(num_heads, "num_attention_heads")
        local_kv, first_kv = kv_heads_of_rank(tp, num_kv_heads)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        kv_pick = (first_kv * head_dim, local_kv * head_dim)
        picks = [(tp.rank * local_heads * head_dim, local_heads * head_dim), kv_pick, kv_pick]
        self._build(tp, hidden_size, [q, kv, kv], picks, bias)
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = local_heads, local_kv
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, (+ b once): x arrives sharded along its features
    (a column-parallel layer's output), W's input columns are split the same way.

    reduce_results=False leaves the partial sum for the caller to reduce (a block that
    adds several partial sums reduces once); it takes no bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 what: str = "in_features", reduce_results: bool = True):
        if bias and not reduce_results:
            raise ValueError("a RowParallelLinear that does not reduce cannot add its bias once")
        tp = current_tp_group()
        local = tp.shard(in_features, what)
        super().__init__(local, out_features, bias)
        self.tp_group = tp
        self.total_in_features = in_features
        self.reduce_results = reduce_results
        first = tp.rank * local
        set_shard_spec(self.weight, ShardSpec(
            (out_features, in_features), ((0, out_features),), (first, first + local)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp_group.distributed:
            return super().forward(x)  # the single-GPU arithmetic: bias fused in the matmul
        return self._reduce(linear(x, self.weight, None))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if not self.reduce_results:
            return partial
        out = self.tp_group.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def forward_gemv_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Small batch (the CUDA GEMV path): x W^T (+ b) + residual. Single process: one
        GEMV with the residual add in its epilogue. Distributed: the partial GEMV is
        summed BEFORE the residual is added (each rank adding it would count it N
        times), then the bias, then the residual."""
        if not self.tp_group.distributed:
            return gemv.gemv(x, self.weight, self.bias, epilogue="residual", residual=residual)
        assert self.reduce_results, "the residual add needs the reduced sum"
        return self._reduce(gemv.gemv(x, self.weight)) + residual


class VocabParallelEmbedding(nn.Module):
    """This rank's ceil(V / N) vocab rows (zero padding past V); a masked lookup summed
    over the ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        tp = current_tp_group()
        self.tp_group = tp
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp.world_size)
        self.vocab_start = min(num_embeddings, tp.rank * self.rows_per_rank)
        self.vocab_end = min(num_embeddings, self.vocab_start + self.rows_per_rank)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim),
                                   requires_grad=False)
        rows = ((self.vocab_start, self.vocab_end),) if self.vocab_end > self.vocab_start else ()
        set_shard_spec(self.weight, ShardSpec(
            (num_embeddings, embedding_dim), rows, (0, embedding_dim)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return self.tp_group.all_reduce(F.embedding(input_ids, self.weight))
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [T, H] -> logits [T, V] on every rank: the rank's vocab rows, gathered."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight, None)
        if self.tp_group.distributed:
            logits = self.tp_group.all_gather(logits, dim=-1)
        if logits.shape[-1] > self.num_embeddings:  # the padded vocab rows' columns
            logits = logits[..., : self.num_embeddings].contiguous()
        return logits
