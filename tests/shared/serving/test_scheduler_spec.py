"""The scheduler with speculative decoding, driven by a fake runner that verifies drafts
by exact match (greedy semantics): whatever the drafts, every request's outputs must equal
the plain-Python run of the same token function (`expected_output`), through chunked
prefill, preemption, prefix caching, stops inside an accepted run and length limits.

The fake writes the KV of every scheduled position, rejected drafts included, and checks
before attending that every slot of a request's context holds the right token: a rejected
draft's slot that was not recomputed, or a prefix-cache block registered with a draft's
KV in it, fails that check.
"""

from __future__ import annotations

import hashlib
import random

import pytest

from shared.contract.sampling_params import SamplingParams
from shared.contract.step import ModelRunnerOutput, SchedulerOutput
from shared.serving.request import Request
from shared.serving.scheduler import Scheduler
from tests.shared.serving.scheduler_fakes import FakeRunner, expected_output, hash_token_fn

EOS = 2


class FakeSpecRunner(FakeRunner):
    """A FakeRunner that verifies drafts (exact match) and proposes k drafts per sampled
    request: the true continuation with a deterministic share of wrong tokens."""

    def __init__(self, *args, k: int, error_rate: float, **kw):
        super().__init__(*args, **kw)
        self.k = k
        self.error_rate = error_rate
        self.num_drafted = 0
        self.num_accepted = 0
        self.max_blocks_held = 0

    def _wrong(self, tokens: list[int], i: int) -> bool:
        h = hashlib.blake2b(bytes(str((tokens[-3:], len(tokens), i)), "utf8"), digest_size=4)
        return int.from_bytes(h.digest(), "little") / 2**32 < self.error_rate

    def _propose(self, st) -> list[int]:
        tokens, drafts = list(st.tokens), []
        for i in range(self.k):
            true = self.token_fn(tokens, st.prompt_len)
            d = (true + 1) % 50 if self._wrong(tokens, i) else true
            drafts.append(d)
            tokens.append(d)
        return drafts

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        spec = so.scheduled_spec_decode_tokens
        req_ids, sampled, drafts_out = [], [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.states[req_id]
            drafts = spec.get(req_id, [])
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            if drafts:
                assert n == 1 + len(drafts) and start == len(st.tokens) - 1, (req_id, n, st)
            # the run's last token (the target's own) must fit max_model_len
            assert end - len(drafts) <= len(st.tokens) and end + 1 <= self.max_model_len + 1
            assert len(st.block_ids) * self.block_size >= end
            self.max_blocks_held = max(self.max_blocks_held, len(st.block_ids))
            seq = st.tokens + drafts
            for pos in range(start, end):
                self.kv[self._slot(st, pos)] = seq[pos]
            for pos in range(end):
                assert self.kv[self._slot(st, pos)] == seq[pos], (req_id, pos)
            req_ids.append(req_id)
            if end < len(st.tokens):  # a partial prefill chunk
                st.num_computed_tokens = end
                sampled.append([])
                drafts_out.append([])
                continue
            run = []
            for d in drafts:  # exact-match verification
                t = self.token_fn(st.tokens + run, st.prompt_len)
                if t != d:
                    break
                run.append(d)
            self.num_drafted += len(drafts)
            self.num_accepted += len(run)
            run.append(self.token_fn(st.tokens + run, st.prompt_len))
            st.num_computed_tokens = start + len(run) if drafts else end
            st.tokens.extend(run)
            sampled.append(run)
            drafts_out.append(self._propose(st))
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, draft_token_ids=drafts_out,
        )


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 2000) -> None:
    for _ in range(max_steps):
        if not (sched.has_unfinished_requests() or sched.has_finished_requests()):
            return
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    raise AssertionError("did not finish")


CONFIGS = {
    "roomy": dict(max_num_batched_tokens=64, num_blocks=64, enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=6, num_blocks=64, enable_prefix_caching=False),
    "tiny_pool": dict(max_num_batched_tokens=32, num_blocks=12, enable_prefix_caching=False),
    "prefix": dict(max_num_batched_tokens=64, num_blocks=64, enable_prefix_caching=True),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_spec_outputs_equal_the_plain_run(config, k, error_rate):
    rng = random.Random(hash((config, k, error_rate)) % 2**32)
    cfg = dict(max_num_seqs=4, max_model_len=40, block_size=4, **CONFIGS[config])
    sched = Scheduler(**cfg, num_speculative_tokens=k, num_lookahead_tokens=k)
    runner = FakeSpecRunner(cfg["num_blocks"], cfg["block_size"], cfg["max_model_len"],
                            hash_token_fn(vocab_size=6), k=k, error_rate=error_rate)
    shared = [rng.randrange(3, 50) for _ in range(8)]
    requests = []
    for i in range(6):
        prompt = (shared if config == "prefix" else []) + [rng.randrange(3, 50)
                                                           for _ in range(rng.randrange(1, 9))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 30), temperature=0.0,
            stop_token_ids=[rng.randrange(0, 6)] if i % 3 == 0 else [],
            ignore_eos=i % 2 == 0,
        )
        requests.append(Request(f"r{i}", prompt, params, EOS, i))
        sched.add_request(requests[-1])
    run_all(sched, runner)
    for r in requests:
        outputs, reason, stop_reason = expected_output(
            r.prompt_token_ids, r.sampling_params, r.eos_token_id, sched.max_model_len,
            runner.token_fn)
        assert (r.output_token_ids, r.finish_reason, r.stop_reason) == (outputs, reason, stop_reason), r
    assert sched.num_free_blocks == sched.num_total_blocks
    stats_drafted = sum(r.spec_decode_stats.num_draft_tokens for r in requests)
    stats_accepted = sum(r.spec_decode_stats.num_accepted_tokens for r in requests)
    # the counters count what the runner verified (a request that finished early in
    # a run still counts the drafts it was scheduled with)
    assert (stats_drafted, stats_accepted) == (runner.num_drafted, runner.num_accepted)
    if error_rate < 1.0 and k > 0:
        assert runner.num_accepted > 0  # the drafts were really used
    if error_rate == 1.0:
        assert runner.num_accepted == 0


def test_drafts_are_trimmed_to_max_tokens_and_max_model_len():
    cfg = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=12, num_blocks=16,
               block_size=4, enable_prefix_caching=False)
    sched = Scheduler(**cfg, num_speculative_tokens=4, num_lookahead_tokens=4)
    runner = FakeSpecRunner(16, 4, 12, hash_token_fn(vocab_size=6), k=4, error_rate=0.0)
    a = Request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), EOS, 0)
    b = Request("b", [5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=50, temperature=0.0,
                                                              ignore_eos=True), EOS, 1)
    sched.add_request(a)
    sched.add_request(b)
    scheduled = []
    while sched.has_unfinished_requests() or sched.has_finished_requests():
        so = sched.schedule()
        scheduled.append(dict(so.scheduled_spec_decode_tokens))
        sched.update_from_output(so, runner.execute(so))
    # a: 1 token from the prefill, then at most max_tokens - 1 - 1 = 1 draft
    assert [len(s["a"]) for s in scheduled if "a" in s] == [1]
    # b: 7 prompt tokens, max_model_len 12: after the prefill 8 tokens, the run may
    # reach 12 tokens: 12 - 7 - 2 = 3 drafts
    assert [len(s["b"]) for s in scheduled if "b" in s] == [3]
    assert a.output_token_ids == expected_output([5, 6, 7], a.sampling_params, EOS, 12, runner.token_fn)[0]
    assert len(b.all_token_ids) == 12 and b.finish_reason == "length"
    # no lookahead block past max_model_len: 12 tokens = 3 blocks of 4 at most
    assert runner.max_blocks_held == 3


def test_async_scheduling_with_host_drafts_is_refused():
    with pytest.raises(ValueError, match="async_scheduling=True with speculative decoding needs"):
        Scheduler(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=8, num_blocks=8,
                  block_size=4, enable_prefix_caching=False, async_scheduling=True,
                  num_speculative_tokens=2)
