"""V1's draft model with FULL graphs for its uniform forwards, on CPU with the eager
stand-ins (tests/shared/runtime/draft_graph_run.py): the tokens and the draft's KV of
the same engine without graphs, and the FULL graphs really replayed, for the
single-token drafts and the uniform catch-up, also over padded rows."""

from __future__ import annotations

from tests.shared.runtime.draft_graph_run import check_full_draft_graphs

K = 2
# the target's own weights (same preset, same seed): its drafts are accepted, so every
# row of a step catches up on k + 2 tokens and the catch-up is uniform
SPEC = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": K}


def test_full_draft_graphs_give_the_eager_tokens_and_kv(monkeypatch):
    replays = check_full_draft_graphs("v1", SPEC, monkeypatch)
    # three rows drafting (padded to the graph of 4), one row alone, a catch-up of k + 2
    # tokens per row, and one of a lone row (V1's catch-up graphs: up to 4 requests)
    assert {(1, 4), (1, 1), (K + 2, 4)} <= set(replays), replays
    assert any(q > 1 and size == 1 for q, size in replays), replays
