"""Batch-invariant mode of the TRITON attention (issue 26), under the interpreter: one
token's output row is bitwise the same whether it is a decode row alone, a decode row at
any position of a batch (with padded rows after it), or a row of a prefill chunk of any
length that contains it (a chunk ending at the token or running past it, after a cached
prefix or from position 0). The oracle is the same token computed the first way; the
mode-off run shows the comparison has teeth (the default configs differ between the two
mappings, and the decode split count follows the batch).

float64 only: the interpreter's tl.dot is numpy's matmul, and OpenBLAS's float32 GEMM
gives a row a different result by its position in the tile (rows 6-11 of a 16-row tile
differ from rows 0-5 on this container's build), which no kernel can undo; its float64
GEMM does not. The float32 and bf16 forms of this check run on the GPU
(tests/gpu/shared/attention/test_batch_invariant_attention_gpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.attention import triton_backend
from shared.attention.metadata import CommonAttentionMetadata
from shared.attention.triton_backend import TritonBackend
from tests.oracles.paged_attention import run_backend

H, HKV, D, BS = 4, 2, 16, 8
CTX = 150  # the needle's context: its token sits at position CTX - 1


class World:
    """One KV cache and one query vector per (request, position): a batch built from it
    shows the same token the same inputs whichever way it is scheduled."""

    def __init__(self, num_reqs: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
        self.device = torch.device(device)
        per_req = -(-(CTX + 16) // BS)
        num_blocks = num_reqs * per_req + 2
        gen = torch.Generator().manual_seed(seed)
        self.key_cache = torch.randn((num_blocks, BS, HKV, D), generator=gen).to(dtype)
        self.value_cache = torch.randn((num_blocks, BS, HKV, D), generator=gen).to(dtype)
        self.queries = torch.randn((num_reqs, CTX + 16, H, D), generator=gen).to(dtype)
        ids = np.random.default_rng(seed).permutation(num_blocks)[: num_reqs * per_req]
        self.tables = ids.reshape(num_reqs, per_req).astype(np.int32)
        self.key_cache, self.value_cache, self.queries = (
            t.to(self.device) for t in (self.key_cache, self.value_cache, self.queries))

    def batch(self, rows: list[tuple[int, int, int]], pad_reqs: int = 0, pad_tokens: int = 0):
        """rows: (request, query_len, seq_len) -> (query, common)."""
        q_lens = [q for _, q, _ in rows]
        seq_lens = [s for _, _, s in rows] + [0] * pad_reqs
        qsl = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_reqs, sum(q_lens))])
        table = np.zeros((len(rows) + pad_reqs, self.tables.shape[1]), np.int32)
        for i, (r, _, _) in enumerate(rows):
            table[i] = self.tables[r]
        query = torch.cat([self.queries[r, s - q: s] for r, q, s in rows]
                          + [self.queries[0, :pad_tokens]])
        dev = self.device
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.from_numpy(table).to(dev),
            slot_mapping=torch.full((query.shape[0],), -1, dtype=torch.int64, device=dev),
            num_reqs=len(rows), num_actual_tokens=sum(q_lens), max_query_len=max(q_lens),
            max_seq_len=max(seq_lens), num_decodes=sum(q == 1 for q in q_lens),
            num_prefills=sum(q != 1 for q in q_lens),
            num_decode_tokens=sum(q == 1 for q in q_lens), block_size=BS,
            query_start_loc_cpu=torch.from_numpy(qsl.astype(np.int32)),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )
        return query, common

    def run(self, rows, **pad) -> torch.Tensor:
        from tests.oracles.paged_attention import Batch

        query, common = self.batch(rows, **pad)
        batch = Batch(common, query, self.key_cache, self.value_cache, common.num_actual_tokens)
        return run_backend(TritonBackend(), batch, H, D, HKV)


def needle_rows(world: World) -> dict[str, torch.Tensor]:
    """The needle (request 0, its token at CTX - 1) computed in each scheduling."""
    last = CTX - 1
    out = {"alone": world.run([(0, 1, CTX)])[0]}
    for pos in (0, 3, 6):  # decode batches of 7 rows, the needle at several positions
        others = [(r, 1, 20 + 17 * r) for r in range(1, 7)]
        rows = others[:pos] + [(0, 1, CTX)] + others[pos:]
        out[f"decode batch, row {pos}"] = world.run(rows, pad_reqs=2, pad_tokens=3)[pos]
    for start, end in ((0, CTX), (CTX - 40, CTX), (CTX - 9, CTX + 7), (last, CTX + 12)):
        # prefill chunks [start, end) holding the token, after other rows' tokens
        rows = [(1, 1, 33), (2, 5, 60), (0, end - start, end)]
        got = world.run(rows, pad_reqs=1, pad_tokens=2)
        out[f"chunk [{start}, {end})"] = got[1 + 5 + (last - start)]
    return out


# The needle's 150 keys in float64 (KV tiles of 16): one split (256), and splits of four
# and eight tiles (64, 128 keys), the last one partial. With the interpreter's one "SM" every
# decode program folds its row's splits itself; with 64 the decode rows (alone: 2
# programs, the batch: 18) leave SMs idle, so each split gets a program and the
# reduction folds the partials. The chunks always fold in their programs.
@pytest.mark.parametrize("split_tokens,num_sms", [(256, 1), (64, 1), (64, 64), (128, 64)])
def test_a_token_is_bitwise_the_same_in_every_scheduling(kernel_opts, monkeypatch,
                                                         split_tokens, num_sms):
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: num_sms)
    kernel_opts(batch_invariant=True, invariant_split_tokens=split_tokens)
    rows = needle_rows(World(7, torch.float64))
    alone = rows.pop("alone")
    assert not alone.isnan().any()
    for name, row in rows.items():
        assert torch.equal(row, alone), name


def test_without_the_mode_the_same_comparison_fails():
    # the check has teeth: the default mappings differ in KV tile, and the decode split
    # count follows the batch
    rows = needle_rows(World(7, torch.float64))
    alone = rows.pop("alone")
    differing = [name for name, row in rows.items() if not torch.equal(row, alone)]
    assert differing, "mode off gave identical rows: the test cannot tell the modes apart"
    for row in rows.values():  # still the same values up to rounding
        torch.testing.assert_close(row, alone, atol=1e-12, rtol=1e-12)


def test_the_split_launches_compile_for_sm90(kernel_opts, monkeypatch, tmp_path):
    # The interpreter runs a kernel's Python, not the compiler (tests/kernel_compile.py):
    # every launch of the fold paths (split programs and the folding reduction, programs
    # that fold; fp16, fp32 and fp64 dots) and of attention_split_tokens' fixed splits
    # compiles.
    from tests.kernel_compile import LaunchRecorder, compile_for_sm90

    kernel_opts(batch_invariant=True, invariant_split_tokens=64)
    with LaunchRecorder() as recorder:
        for num_sms, dtypes in ((1, (torch.float32,)), (64, (torch.float64, torch.float16))):
            monkeypatch.setattr(triton_backend, "_num_sms", lambda device, n=num_sms: n)
            for dtype in dtypes:
                needle_rows(World(7, dtype))
        kernel_opts(batch_invariant=False, attention_split_tokens=128)
        needle_rows(World(7, torch.float16))
    folds = [e for e in recorder.launches.values()
             if e["kernel"].endswith("reduce_splits_kernel") and e["constexprs"].get("FOLD")]
    assert folds, "no folding reduction was launched"
    failures = compile_for_sm90(list(recorder.launches.values()), tmp_path)
    assert not failures, "\n".join(failures)
    assert not recorder.unrecorded, sorted(recorder.unrecorded)
