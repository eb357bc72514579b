"""shared/sampling/prompt_logprobs.py against plain NumPy / Python oracles: the logprob,
rank and top-k of each row (float64 and float32 logits, ties, k = 0), the positions a
chunk covers, the request tracking fed from SchedulerOutputs, the row slicing of the
logits passes, and the output packaging."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import shared.sampling.prompt_logprobs as plp_mod
from shared.contract.sampling_params import SamplingParams
from shared.contract.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from shared.sampling.prompt_logprobs import (
    PromptLogprobsRequests,
    attach_prompt_logprobs,
    compute_prompt_logprobs,
    compute_rows,
    prompt_span,
)


def oracle_lse(row: np.ndarray) -> float:
    """Plain Python float64 logsumexp."""
    x = [float(v) for v in row]
    m = max(x)
    return m + math.log(sum(math.exp(v - m) for v in x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [0, 1, 4])
def test_matches_oracle(dtype, k) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 50, generator=gen)).to(dtype)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie at the top
    targets = torch.tensor([0, 5, 9, 49, 3, 7])
    ids, lps, ranks = compute_prompt_logprobs(logits, targets, k)
    assert ids.shape == lps.shape == (6, 1 + k) and ranks.shape == (6,)
    assert lps.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rounded = np.float64 if dtype == torch.float64 else np.float32
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    for i in range(6):
        row = [float(v) for v in logits[i]]
        target = int(targets[i])
        assert ids[i, 0] == target
        assert int(ranks[i]) == 1 + sum(v > row[target] for v in row)
        # the top-k by value (an exact tie across the k-th place may go either way)
        assert sorted((row[t] for t in ids[i, 1:].tolist()), reverse=True) == sorted(
            row, reverse=True)[:k]
        lse = oracle_lse(logits[i].numpy())
        for t, lp in zip(ids[i].tolist(), lps[i].tolist()):
            want = float(rounded(row[t] - lse))  # one rounding to the compute dtype
            assert abs(lp - want) <= tol * max(1.0, abs(want))
    assert int(ranks[2]) == 1  # a tied maximum: nothing strictly larger


def test_bf16_logits_compute_in_float32() -> None:
    logits = torch.randn(3, 20).to(torch.bfloat16)
    ids, lps, _ = compute_prompt_logprobs(logits, torch.tensor([1, 2, 3]), 2)
    assert lps.dtype == torch.float32
    ref = torch.log_softmax(logits.double(), dim=-1).gather(1, ids).float()
    assert torch.allclose(lps, ref, atol=1e-6)


@pytest.mark.parametrize("nc, ns, plen, want", [
    (0, 5, 5, (0, 4)),  # whole prompt: positions 0..3 predict tokens 1..4
    (0, 3, 8, (0, 3)),  # a chunk: its last position predicts the next chunk's first
    (3, 3, 8, (3, 3)),
    (6, 2, 8, (6, 1)),  # the last position predicts the first output: not prompt
    (0, 1, 1, (0, 0)),  # a one-token prompt has nothing to predict
    (0, 12, 8, (0, 7)),  # a resumed prefill: past prompt_len are outputs
    (9, 1, 8, (9, 0)),  # a decode
])
def test_prompt_span(nc, ns, plen, want) -> None:
    assert prompt_span(nc, ns, plen) == want


def new_req(req_id: str, prompt: list[int], k: int | None, outputs=()) -> NewRequestData:
    return NewRequestData(req_id, list(prompt) + list(outputs),
                          SamplingParams(prompt_logprobs=k), [], 0, len(prompt))


def step(new=(), finished=(), preempted=()) -> SchedulerOutput:
    return SchedulerOutput(list(new), CachedRequestData(), {}, 0, set(finished), set(preempted))


def test_tracking() -> None:
    reqs = PromptLogprobsRequests(keep_prompt=True)
    reqs.update(step([new_req("a", [5, 6, 7], 2), new_req("b", [8, 9], None),
                      new_req("c", [1, 2, 3, 4], 0, outputs=[9, 9])]))
    assert sorted(reqs.requests) == ["a", "c"]
    assert reqs.prompt("c").tolist() == [1, 2, 3, 4]  # the user prompt, not the outputs
    # abort then resubmit in one step, now without prompt_logprobs: not tracked
    reqs.update(step([new_req("a", [5, 6], None)], finished={"a"}))
    assert sorted(reqs.requests) == ["c"]
    reqs.update(step(preempted={"c"}))
    assert not reqs
    reqs.update(step([new_req("d", [1, 2], 1)]))
    reqs.clear()
    assert not reqs


def test_rows_for_step_chunks_and_drops_finished_prompts() -> None:
    reqs = PromptLogprobsRequests(keep_prompt=True)
    prompt = [10, 11, 12, 13, 14, 15]
    reqs.update(step([new_req("a", prompt, 1), new_req("z", [3, 4, 5], 2)]))
    # batch: "x" (untracked) at position 0 with 2 tokens, "a" at position 1; "z" unscheduled
    where = {"x": 0, "a": 1}
    tokens = lambda req_id, i: reqs.prompt(req_id)  # noqa: E731
    rows = reqs.rows_for_step(where.get, np.array([0, 0]), np.array([2, 4]),
                              np.array([0, 2, 6]), tokens)
    assert rows.req_ids == ["a"] and rows.starts == [1] and rows.counts == [4]
    assert rows.hidden_rows[0].tolist() == [2, 3, 4, 5]
    assert rows.targets[0].tolist() == [11, 12, 13, 14]
    assert "a" in reqs.requests  # position 4 still predicts token 5
    rows = reqs.rows_for_step(where.get, np.array([0, 4]), np.array([1, 2]),
                              np.array([0, 1, 3]), tokens)
    assert rows.starts == [5] and rows.counts == [1] and rows.targets[0].tolist() == [15]
    assert rows.hidden_rows[0].tolist() == [1]
    assert sorted(reqs.requests) == ["z"]  # "a" is done: dropped


def test_compute_rows_slices_passes_and_fills_output(monkeypatch) -> None:
    monkeypatch.setattr(plp_mod, "MAX_ROWS_PER_PASS", 2)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(7, 4, dtype=torch.float64, generator=gen)
    weight = torch.randn(30, 4, dtype=torch.float64, generator=gen)
    passes = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        passes.append(h.shape[0])
        return h @ weight.T

    reqs = PromptLogprobsRequests(keep_prompt=True)
    reqs.update(step([new_req("a", [1, 2, 3, 4], 0), new_req("b", [5, 6, 7, 8, 9], 3)]))
    where = {"a": 0, "b": 1}
    rows = reqs.rows_for_step(where.get, np.array([0, 0]), np.array([3, 4]),
                              np.array([0, 3, 7]), lambda r, i: reqs.prompt(r))
    pending = compute_rows(rows, hidden, compute_logits)
    assert passes == [2, 2, 2, 1]  # 7 rows, two at a time
    output = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [])
    tensors, fill = attach_prompt_logprobs(
        pending, {"sampled": torch.tensor([0, 0])},
        lambda out, host: setattr(out, "sampled_token_ids", host["sampled"].tolist()))
    fill(output, {k: t.clone() for k, t in tensors.items()})  # the host copies
    assert output.sampled_token_ids == [0, 0]  # the output's own fill still runs
    # the oracle: every row's logits on their own (a GEMM's last bits may depend on
    # its row count, so this is close, not bit-equal, to the 2-row passes)
    logits = torch.stack([weight @ h for h in hidden])
    full = compute_prompt_logprobs(logits, torch.tensor([2, 3, 4, 6, 7, 8, 9]), 3)
    a, b = output.prompt_logprobs["a"], output.prompt_logprobs["b"]
    assert (a.start, b.start) == (1, 1)
    assert a.token_ids == [row[:1] for row in full[0][:3].tolist()]  # k = 0: the token
    assert b.token_ids == full[0][3:].tolist()
    got = [row[0] for row in a.logprobs] + [x for row in b.logprobs for x in row]
    want = full[1][:3, 0].tolist() + full[1][3:].flatten().tolist()
    assert np.allclose(got, want, rtol=0, atol=1e-12)
    assert a.ranks + b.ranks == full[2].tolist()
    assert attach_prompt_logprobs(None, tensors, fill) == (tensors, fill)
    assert compute_rows(reqs.rows_for_step(where.get, np.array([9, 9]), np.array([1, 1]),
                                           np.array([0, 1, 2]), lambda r, i: reqs.prompt(r)),
                        hidden, compute_logits) is None
