"""V1's built-in logits processors (allowed_token_ids, logit_bias, bad words) against the
NumPy oracle (tests/oracles/sampling_reference.py), driven through the whole V1 path:
rows in a PersistentBatch, its SamplingMetadata, the Sampler. Tokens and logprobs equal
reference_sample_row, and the processed logits equal the oracle's bit for bit; rows
moved by condense / swap_states keep their own built-ins and a vacated row leaks none;
bad words follow the output tail from step to step (also under async scheduling)."""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest
import torch

import runner_v1.sampler as v1_sampler
from runner_v1.builtin_processors import banned_bad_word_tokens
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.request_state import CachedRequestState
from runner_v1.sampler import Sampler, compute_dtype, process_logits
from shared.contract.sampling_params import SamplingParams
from tests.oracles.sampling_reference import processed_logits
from tests.runner_v1.test_sampler import Row, check_against_reference, random_rows

VOCAB = 64
EOS = 3
MAX_MODEL_LEN = 64


# ---- the V1 path -------------------------------------------------------------------------


def state_of(req_id: str, row: Row) -> CachedRequestState:
    """The row as a request whose outputs so far arrive as resumed outputs (the prefill
    carries them; penalties, min_tokens and bad words count them as outputs)."""
    return CachedRequestState(
        req_id=req_id, prompt_token_ids=row.prompt + row.outputs, prompt_len=len(row.prompt),
        sampling_params=row.params, eos_token_id=row.eos, block_ids=[1], num_computed_tokens=0,
        output_token_ids=row.outputs)  # the same list: a step's append shows in both


def batch_of(rows: list[Row], vocab: int = VOCAB, max_num_reqs: int | None = None
             ) -> PersistentBatch:
    batch = PersistentBatch(max_num_reqs or len(rows), MAX_MODEL_LEN, MAX_MODEL_LEN, vocab, 16,
                            "cpu")
    for i, row in enumerate(rows):
        batch.add_request(state_of(f"r{i}", row))
    return batch


def sample_batch(batch: PersistentBatch, rows_by_id: dict[str, Row], logits: torch.Tensor):
    """One step: the batch's metadata, the positions of its rows, the V1 sampler."""
    md = batch.refresh_sampling_metadata()
    rows = [rows_by_id[r] for r in batch.req_ids]
    positions = torch.tensor([r.pos for r in rows], dtype=torch.int64)
    return Sampler()(logits, md, positions), md, rows


def assert_processed_logits_bit_identical(logits: torch.Tensor, md, rows: list[Row]) -> None:
    x = process_logits(logits.to(compute_dtype(logits)), md).numpy()
    for i, r in enumerate(rows):
        ref = processed_logits(logits[i].numpy().astype(x.dtype), r.params, r.pos, r.prompt,
                               r.outputs, r.eos)
        assert x.dtype == ref.dtype and np.array_equal(x[i], ref), f"row {i}"


# ---- random cases ------------------------------------------------------------------------


def with_allowed(rng: np.random.Generator, row: Row, vocab: int) -> dict:
    ids = rng.choice(vocab, int(rng.integers(1, 9)), replace=False).tolist()
    return dict(allowed_token_ids=ids + [vocab + 3])  # an id past the vocabulary: ignored


def with_bias(rng: np.random.Generator, row: Row, vocab: int) -> dict:
    ids = rng.choice(vocab, int(rng.integers(1, 7)), replace=False).tolist()
    # float64 values that float32 rounds: the oracle adds float32(b) widened
    bias = {t: float(rng.uniform(-100, 100)) for t in ids}
    return dict(logit_bias={**bias, vocab + 1: 50.0})


def with_bad_words(rng: np.random.Generator, row: Row, vocab: int) -> dict:
    tail = row.outputs[-2:]
    words = [[int(rng.integers(vocab))]]  # one token: always banned
    if tail:
        words.append(tail + [int(rng.integers(vocab))])  # prefix matches the tail
        words.append([(tail[0] + 1) % vocab] + tail[1:] + [int(rng.integers(vocab))])  # not
    words.append([int(rng.integers(vocab)), vocab + 2])  # banned token past the vocabulary
    return dict(bad_words_token_ids=words)


BUILTINS = {"allowed": with_allowed, "bias": with_bias, "bad_words": with_bad_words}
SAMPLING = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.8),
    "filtered": dict(temperature=1.2, top_k=12, top_p=0.9, min_p=0.02),
    "penalties_min_tokens": dict(temperature=0.9, repetition_penalty=1.4,
                                 frequency_penalty=0.5, presence_penalty=-0.3, min_tokens=4,
                                 stop_token_ids=[5, 7], logprobs=3),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=0.7, presence_penalty=1.1,
                             min_tokens=3, logprobs=0),
}


def builtin_case(kinds: tuple[str, ...], sampling: str, dtype: torch.dtype, n: int = 20):
    """Rows with the built-ins `kinds`, mixed with plain random and greedy rows, and logits
    on which the built-ins matter: the tokens they act on are pushed to the top."""
    rng = np.random.default_rng(zlib.crc32(f"{kinds}{sampling}".encode()))
    rows = random_rows(rng, n, VOCAB, **SAMPLING[sampling])
    logits = rng.normal(0, 3, (n, VOCAB))
    for i, row in enumerate(rows):
        extra = {}
        for kind in kinds:
            extra.update(BUILTINS[kind](rng, row, VOCAB))
        row.params = replace(row.params, **extra)
        for word in extra.get("bad_words_token_ids", []):
            if word[-1] < VOCAB:
                logits[i, word[-1]] += 9.0  # banned only when the prefix matches
        logits[i, [EOS, 5, 7]] += 6.0  # min_tokens' masked ids
    rows += random_rows(rng, 2, VOCAB, temperature=1.0) + random_rows(rng, 2, VOCAB, temperature=0.0)
    logits = np.concatenate([logits, rng.normal(0, 3, (4, VOCAB))])
    return rows, torch.from_numpy(logits).to(dtype)


def without_builtins(row: Row) -> Row:
    sp = replace(row.params, allowed_token_ids=None, logit_bias=None, bad_words_token_ids=None)
    return Row(sp, row.prompt, row.outputs, row.eos)


KIND_SETS = [("allowed",), ("bias",), ("bad_words",), ("allowed", "bias", "bad_words"),
             ("bias", "bad_words")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("kinds", KIND_SETS, ids="+".join)
def test_matches_reference(kinds, sampling, dtype) -> None:
    rows, logits = builtin_case(kinds, sampling, dtype)
    batch = batch_of(rows)
    by_id = dict(zip(batch.req_ids, rows))
    out, md, ordered = sample_batch(batch, by_id, logits)
    check_against_reference(logits, ordered, out)
    assert_processed_logits_bit_identical(logits, md, ordered)
    assert (md.allowed_token_mask is None) == ("allowed" not in kinds)
    assert (md.logit_bias_index is None) == ("bias" not in kinds)
    assert (md.bad_words is None) == ("bad_words" not in kinds)
    # non-vacuity: the same rows without their built-ins sample other tokens
    plain = [without_builtins(r) for r in rows]
    plain_out, plain_md, _ = sample_batch(batch_of(plain), dict(zip(batch.req_ids, plain)), logits)
    assert not plain_md.uses_builtin_processors
    assert not torch.equal(plain_out.sampled_token_ids, out.sampled_token_ids)


# ---- crafted cases: each built-in changes the token ----------------------------------------


def greedy_row(outputs: list[int] = (), **params) -> Row:
    return Row(SamplingParams(temperature=0.0, seed=1, **params), [1, 2], list(outputs))


def greedy_logits(top: list[int]) -> torch.Tensor:
    """float32 [VOCAB]: the tokens in `top` ranked first, in that order."""
    x = torch.linspace(-1.0, 0.0, VOCAB)
    for rank, t in enumerate(top):
        x[t] = 10.0 - rank
    return x


def sampled_alone(row: Row, logits: torch.Tensor) -> int:
    out, md, rows = sample_batch(batch_of([row]), {"r0": row}, logits[None])
    check_against_reference(logits[None], rows, out)
    assert_processed_logits_bit_identical(logits[None], md, rows)
    return int(out.sampled_token_ids[0])


@pytest.mark.parametrize(("params", "expected"), [
    (dict(), 40),
    (dict(allowed_token_ids=[9, 12]), 9),  # 40 and 41 outside the list
    (dict(logit_bias={40: -3.5}), 41),
    (dict(logit_bias={12: 4.25}), 12),
    (dict(allowed_token_ids=[9, 12], logit_bias={12: 1.5}), 12),
    (dict(bad_words_token_ids=[[40]]), 41),
    (dict(bad_words_token_ids=[[40], [41]]), 9),
])
def test_each_builtin_changes_the_greedy_token(params, expected) -> None:
    logits = greedy_logits([40, 41, 9, 12])  # 9 above 12
    assert sampled_alone(greedy_row([5, 6], **params), logits) == expected


@pytest.mark.parametrize(("word", "banned"), [
    ([6, 40], True),  # prefix [6] is the tail
    ([5, 6, 40], True),  # the whole output is the prefix
    ([5, 40], False),  # 5 is in the outputs, not at their end
    ([7, 6, 40], False),  # the tail matches, the token before it does not
    ([4, 5, 6, 40], False),  # longer than the outputs
    ([40], True),
])
def test_multi_token_word_bans_only_after_its_prefix(word, banned) -> None:
    row = greedy_row([5, 6], bad_words_token_ids=[word])
    assert sampled_alone(row, greedy_logits([40, 41])) == (41 if banned else 40)
    rows, cols = banned_bad_word_tokens({0: ((tuple(word[:-1]), word[-1]),)}, [[5, 6]], VOCAB)
    assert (rows, cols) == (([0], [40]) if banned else ([], []))


def test_bad_words_count_resumed_outputs_not_the_prompt() -> None:
    """After a preemption the prefill holds prompt + outputs; only the outputs match."""
    row = Row(SamplingParams(temperature=0.0, seed=1, bad_words_token_ids=[[2, 40]]), [1, 2], [])
    assert sampled_alone(row, greedy_logits([40, 41])) == 40  # the prompt ends with 2
    resumed = Row(row.params, [1, 2], [3, 2])
    assert sampled_alone(resumed, greedy_logits([40, 41])) == 41


def test_logit_bias_is_the_float32_value_added_in_float64() -> None:
    """0.1 is not a float32: a float64 bias would give another sum in float64."""
    logits = torch.zeros(1, VOCAB, dtype=torch.float64)
    row = greedy_row(logit_bias={3: 0.1})
    md = batch_of([row]).refresh_sampling_metadata()
    x = process_logits(logits, md)
    assert x.dtype == torch.float64 and x[0, 3].item() == float(np.float32(0.1)) != 0.1
    assert md.logit_bias_values.dtype == torch.float32


# ---- rows that move ------------------------------------------------------------------------


def test_moved_rows_keep_their_builtins_and_vacated_rows_leak_nothing() -> None:
    """vLLM V1's latent bugs (../shared/reference/vllm-runners.md, 'Not cleared', and the
    swap of mask rows by tuple assignment of views): A (allowed ids, bias) sits in the top
    row; a lower row finishes, condense moves A down; an unconstrained C lands in A's
    vacated row; then A is swapped with X; then B (bad words) leaves and D takes its row."""
    logits_row = greedy_logits([40, 41, 5, 6])
    expected = {"X": 40, "Y": 40, "A": 6, "B": 41, "C": 40, "D": 40}
    rows = {
        "X": greedy_row([8]),
        "Y": greedy_row([8]),
        "B": greedy_row([8], bad_words_token_ids=[[8, 40]]),
        "A": greedy_row([8], allowed_token_ids=[5, 6], logit_bias={6: 2.0}),
        "C": greedy_row([8]),
        "D": greedy_row([8]),
    }
    batch = PersistentBatch(4, MAX_MODEL_LEN, MAX_MODEL_LEN, VOCAB, 16, "cpu")

    def step() -> None:
        n = batch.num_reqs
        logits = logits_row.expand(n, -1).contiguous()
        out, md, ordered = sample_batch(batch, rows, logits)
        check_against_reference(logits, ordered, out)
        got = dict(zip(batch.req_ids, out.sampled_token_ids.tolist()))
        assert got == {r: expected[r] for r in batch.req_ids}
        assert_processed_logits_bit_identical(logits, md, ordered)

    for name in "XYBA":
        batch.add_request(state_of(name, rows[name]))
    step()
    batch.remove_request("Y")
    batch.condense()
    assert batch.req_ids == ["X", "A", "B"]
    step()  # adds come before the moves of a step: C arrives in the next one
    assert batch.add_request(state_of("C", rows["C"])) == 3  # A's vacated row
    step()
    batch.swap_states(0, 1)
    assert batch.req_ids == ["A", "X", "B", "C"]
    step()
    batch.remove_request("B")
    assert batch.add_request(state_of("D", rows["D"])) == 2  # B's row: its bad words gone
    step()
    batch.reorder_decodes_first({"A": 2, "X": 1, "D": 1, "C": 2})
    assert batch.req_ids == ["D", "X", "A", "C"]  # A and D traded rows
    step()


def test_bad_words_follow_the_output_tail_across_steps() -> None:
    """A decode loop on a small vocabulary (prefixes match often): the metadata is built
    once and each step matches the words against the outputs as they grow."""
    vocab, rng = 12, np.random.default_rng(5)
    words = [[3], [1, 2], [2, 1], [4, 4, 5], [0, 6, 7]]
    rows = []
    for i in range(8):
        rows.append(Row(SamplingParams(
            temperature=0.0 if i % 2 else 1.1, seed=i, max_tokens=64,
            bad_words_token_ids=words[i % 3:], repetition_penalty=1.1 if i == 3 else 1.0),
            [int(t) for t in rng.integers(0, vocab, 3)], []))
    batch = batch_of(rows, vocab)
    by_id = dict(zip(batch.req_ids, rows))
    md0 = batch.refresh_sampling_metadata()
    multi_token_bans = 0
    for _ in range(24):
        logits = torch.from_numpy(rng.normal(0, 1.5, (len(rows), vocab))).float()
        logits[:, [2, 1, 5, 7]] += 2.0  # the words' last tokens: often the winners
        banned_rows, banned_cols = banned_bad_word_tokens(md0.bad_words, md0.output_token_ids,
                                                          vocab)
        multi_token_bans += sum(c != 3 for c in banned_cols)
        out, md, ordered = sample_batch(batch, by_id, logits)
        assert md is md0  # not rebuilt: the bans come from the live output lists
        check_against_reference(logits, ordered, out)
        assert_processed_logits_bit_identical(logits, md, ordered)
        tokens = out.sampled_token_ids.numpy()
        batch.append_output_tokens(np.arange(len(rows)), tokens.astype(np.int32))
        for row, t in zip(ordered, tokens.tolist()):
            row.outputs.append(t)  # the request's list itself (state_of shares it)
    assert multi_token_bans >= 10


def test_no_builtins_keeps_the_fast_path(monkeypatch) -> None:
    """A batch without built-ins (nor penalties, min_tokens, logprobs) builds none of their
    parts and samples from the logits as they are; one row with a built-in takes the
    processing path."""
    calls = []
    monkeypatch.setattr(v1_sampler, "process_logits",
                        lambda raw, md: calls.append(1) or process_logits(raw, md))
    rows = [greedy_row([5]), Row(SamplingParams(temperature=0.7, seed=2), [4], [])]
    md = batch_of(rows).refresh_sampling_metadata()
    assert (md.allowed_token_mask, md.logit_bias_index, md.logit_bias_values, md.bad_words) == (
        None, None, None, None)
    Sampler()(torch.zeros(2, VOCAB), md, torch.tensor([1, 0]))
    assert calls == []
    for extra in (dict(allowed_token_ids=[1]), dict(logit_bias={1: 1.0}),
                  dict(bad_words_token_ids=[[1]])):
        rows[1].params = replace(rows[1].params, **extra)
        Sampler()(torch.zeros(2, VOCAB), batch_of(rows).refresh_sampling_metadata(),
                  torch.tensor([1, 0]))
        rows[1].params = replace(rows[1].params, allowed_token_ids=None, logit_bias=None,
                                 bad_words_token_ids=None)
    assert calls == [1, 1, 1]



# ---- async scheduling ------------------------------------------------------------------------


def _engine_tokens(params: dict[str, SamplingParams], async_scheduling: bool,
                   prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    from policy import EngineArgs
    from shared.serving.engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(
        model="tiny-llama", dtype="float64", model_runner="v1", seed=0,
        enable_prefix_caching=False, max_model_len=64, block_size=4, max_num_seqs=8,
        max_num_batched_tokens=48, num_gpu_blocks_override=160,
        async_scheduling=async_scheduling))
    for req_id, sp in params.items():
        engine.add_request(req_id, prompts[req_id], sp)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    if async_scheduling:
        assert not engine.runner.in_flight  # every placeholder landed
    return tokens


def test_async_scheduling_lands_outputs_for_bad_words() -> None:
    """Under async scheduling the latest outputs are placeholders until landed; the bad
    words must be matched on the landed tokens, as the synchronous engine does. Words
    are cut from the unconstrained outputs (prefix: the token at step k, banned: the one
    at k + 1), so the prefix matches right after the step whose token may be in flight."""
    rng = np.random.default_rng(11)
    prompts = {str(i): rng.integers(1, 500, int(rng.integers(3, 12))).tolist() for i in range(6)}
    base = {r: SamplingParams(max_tokens=12, temperature=0.0 if int(r) % 2 else 0.7, seed=int(r),
                              ignore_eos=True) for r in prompts}
    free = _engine_tokens(base, False, prompts)
    constrained = {}
    for r, sp in base.items():
        out = free[r]
        words = [out[3:5], out[6:9]]  # two and three tokens
        extra = dict(bad_words_token_ids=words)
        if r == "0":
            extra.update(allowed_token_ids=sorted(set(out) | {7, 8}), logit_bias={out[1]: -5.0})
        constrained[r] = replace(sp, **extra)
    sync = _engine_tokens(constrained, False, prompts)
    assert all(sync[r] != free[r] for r in prompts)  # the words changed every request
    assert _engine_tokens(constrained, True, prompts) == sync
