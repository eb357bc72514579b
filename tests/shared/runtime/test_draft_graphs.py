"""The draft model's graph plan (shared/runtime/draft_graphs.py) against plain references
written here: which forwards replay FULL graphs and at what padded size, which graphs a
configuration captures, and what the persistent metadata holds before a replay (real
rows, then padding over whatever an earlier, larger forward left). The replays
themselves run in tests/runner_v1/spec_decode/test_draft_full_graphs.py and its V2 twin
(CPU, eager stand-ins) and tests/gpu/shared/serving/test_draft_graphs_gpu.py."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from policy.kernel_options import KernelOptions
from shared.attention.metadata import PAD_SLOT_ID, CommonAttentionMetadata
from shared.runtime.cudagraph_utils import BatchDescriptor
from shared.runtime.draft_graphs import DraftFullGraphs, dispatch_draft, draft_graph_config

FULL = {1: [1, 2, 4, 8], 5: [1, 2, 4]}
PIECEWISE = [1, 2, 4, 8, 16]


def reference_plan(query_lens: list[int], full: dict, piecewise: list[int]):
    """The rule in words: every request the same q with a FULL size >= their count for
    that q -> FULL at the smallest such size; else the smallest piecewise size >= the
    tokens; else eager (None)."""
    n, tokens = len(query_lens), sum(query_lens)
    if tokens == 0:
        return None
    if len(set(query_lens)) == 1:
        bigger = [s for s in full.get(query_lens[0], []) if s >= n]
        if bigger:
            return ("FULL", min(bigger) * query_lens[0], min(bigger), query_lens[0])
    bigger = [s for s in piecewise if s >= tokens]
    return ("PIECEWISE", min(bigger), None, 1) if bigger else None


@pytest.mark.parametrize("full,piecewise", [(FULL, PIECEWISE), ({}, PIECEWISE), (FULL, []),
                                            ({}, [])])
def test_dispatch_matches_the_rule(full, piecewise):
    cases = [list(c) for n in range(1, 6) for c in itertools.product([1, 2, 5], repeat=n)]
    cases += [[1] * 9, [5] * 5, [3] * 4, [0, 0], [16], [17]]
    for lens in cases:
        desc = dispatch_draft(len(lens), sum(lens), max(lens), full, piecewise)
        got = None if desc is None else (desc.mode, desc.num_tokens, desc.num_reqs,
                                         desc.uniform_query_len)
        assert got == reference_plan(lens, full, piecewise), lens


def _config(mode="FULL_AND_PIECEWISE", sizes=(1, 2, 4, 8, 16), max_num_seqs=8,
            draft_full_graphs=True):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes)),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        kernel_options=KernelOptions(draft_full_graphs=draft_full_graphs))


TRITON = SimpleNamespace(supports_full_cudagraph=True)
TORCH = SimpleNamespace(supports_full_cudagraph=False)


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("backend", [TRITON, TORCH])
@pytest.mark.parametrize("switch", [True, False])
@pytest.mark.parametrize("on_cuda", [True, False])
def test_config_captures_full_graphs_only_where_all_allow_them(mode, backend, switch, on_cuda):
    lens = {1: 1 << 30, 5: 2}  # q -> the most requests
    got = draft_graph_config(_config(mode, draft_full_graphs=switch), on_cuda, backend, lens, 24)
    graphs_on = on_cuda and mode != "NONE"
    assert got.piecewise_sizes == ([1, 2, 4, 8, 16] if graphs_on else [])
    full_on = graphs_on and mode in ("FULL", "FULL_AND_PIECEWISE") and backend is TRITON and switch
    # q = 1: every size up to max_num_seqs 8; q = 5: at most 2 requests (and 5 * s <= 24)
    assert got.full_sizes == ({1: [1, 2, 4, 8], 5: [1, 2]} if full_on else {})
    assert got.enabled == graphs_on


def test_config_keeps_full_batches_within_the_token_budget():
    got = draft_graph_config(_config(max_num_seqs=16), True, TRITON, {1: 99, 6: 99}, 20)
    assert got.full_sizes == {1: [1, 2, 4, 8, 16], 6: [1, 2]}  # 6 * 4 > 20
    assert got.piecewise_sizes == [1, 2, 4, 8, 16]


MAX_MODEL_LEN, BLOCK = 64, 16
WIDTH = MAX_MODEL_LEN // BLOCK


def _full_graphs(sizes=None) -> DraftFullGraphs:
    executor = SimpleNamespace(config=SimpleNamespace(
        scheduler_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
        cache_config=SimpleNamespace(block_size=BLOCK)))
    t = 64
    return DraftFullGraphs(executor, sizes or {1: [1, 2, 4, 8], 3: [1, 4]},
                           torch.zeros(t, dtype=torch.int32), torch.zeros(t, dtype=torch.int64),
                           torch.full((t,), PAD_SLOT_ID, dtype=torch.int64))


def _common(seq_lens: list[int], q: int, table: torch.Tensor) -> CommonAttentionMetadata:
    n = len(seq_lens)
    return CommonAttentionMetadata(
        query_start_loc=torch.arange(0, n * q + 1, q, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        slot_mapping=torch.zeros(n * q, dtype=torch.int64), num_reqs=n, num_actual_tokens=n * q,
        max_query_len=q, max_seq_len=max(seq_lens), num_decodes=n if q == 1 else 0,
        num_prefills=0 if q == 1 else n, num_decode_tokens=n if q == 1 else 0, block_size=BLOCK)


def _reference(seq_lens, q, table, size):
    """What a graph of `size` rows must read: the real rows, then rows that attend to
    nothing (seq_len 0, block-table row 0, an empty query range)."""
    n = len(seq_lens)
    qsl = [min(i, n) * q for i in range(size + 1)]
    lens = list(seq_lens) + [0] * (size - n)
    rows = table.tolist() + [[0] * WIDTH] * (size - n)
    return qsl, lens, rows


# (query length, real rows, padded rows), in this order over the same buffers: each
# forward meets what the one before left (larger batches, the other q's layout)
SEQUENCE = [(1, 7, 8), (3, 4, 4), (1, 3, 4), (1, 1, 1), (3, 1, 1), (3, 3, 4), (1, 2, 2),
            (1, 2, 2), (1, 5, 8)]


def test_stage_writes_the_real_rows_and_neutralises_the_padding():
    full = _full_graphs()
    gen = torch.Generator().manual_seed(0)
    for q, n, size in SEQUENCE:
        seq_lens = torch.randint(q, MAX_MODEL_LEN, (n,), generator=gen).tolist()
        table = torch.randint(1, 100, (n, WIDTH), generator=gen, dtype=torch.int32)
        full.stage(BatchDescriptor("FULL", size * q, size, q), _common(seq_lens, q, table))
        qsl, lens, rows = _reference(seq_lens, q, table, size)
        assert full.query_start_loc[q][: size + 1].tolist() == qsl, (q, n, size)
        assert full.seq_lens[:size].tolist() == lens, (q, n, size)
        assert full.block_table[:size].tolist() == rows, (q, n, size)


def test_stage_reads_sources_written_in_place():
    """A proposer that wrote seq_lens / block-table rows into the persistent buffers
    itself passes those views: nothing is copied over them, the padding still is."""
    full = _full_graphs()
    full.seq_lens.fill_(9)
    full.block_table.fill_(7)
    full.seq_lens[:3] = torch.tensor([5, 6, 7], dtype=torch.int32)
    common = _common([5, 6, 7], 1, full.block_table[:3])
    common.seq_lens = full.seq_lens[:3]
    full.stage(BatchDescriptor("FULL", 4, 4, 1), common)
    assert full.seq_lens[:4].tolist() == [5, 6, 7, 0]
    assert full.block_table[:4].tolist() == [[7] * WIDTH] * 3 + [[0] * WIDTH]
    assert full.query_start_loc[1][:5].tolist() == [0, 1, 2, 3, 3]
