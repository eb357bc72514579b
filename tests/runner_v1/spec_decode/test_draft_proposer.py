"""V1DraftProposer against a from-scratch oracle: Hugging Face transformers'
LlamaForCausalLM with the draft's weights (float64, tests/oracles/hf_float64.py), run
without a cache over the whole sequence for every single draft.

The proposer is driven by hand, with no target model and no scheduler: a PersistentBatch
is filled step by step as the V1 runner would fill it, blocks are allocated by the
scheduler's rule (a running request gets k lookahead slots, a new one none), the
scheduled drafts are written past num_tokens, the test's plan decides how many of them
are accepted, the accepted run and a "target" token are appended, and
num_computed_tokens drops by the rejected drafts. So the catch-up lengths vary from 1
(a one-token prefill chunk) to num_scheduled + 1, and the scenario reaches a partial
prefill, both caps (max_model_len, and the allocated blocks of a new request), a
request scheduled out for a step and back, and a finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from policy import EngineArgs
from policy.model_config import build_model_config
from runner_v1.persistent_batch import PersistentBatch
from runner_v1.request_state import CachedRequestState
from runner_v1.spec_decode.draft_inputs import StepTokens
from runner_v1.spec_decode.draft_proposer import V1DraftProposer
from shared.contract.sampling_params import SamplingParams
from shared.sampling.noise import DRAFT_SALT
from tests.oracles.hf_float64 import hf_logits, hf_oracle
from tests.oracles.sampling_reference import reference_noise

K = 3
BLOCK = 4
MAX_LEN = 40
MAX_SEQS = 6
MAX_TOKENS = 64
NUM_BLOCKS = 96


def engine_config(backend: str = "TORCH"):
    return EngineArgs(
        model="tiny-llama", dtype="float64", device="cpu", model_runner="v1",
        max_model_len=MAX_LEN, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS,
        block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, attention_backend=backend,
    ).create_engine_config()


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """(directory of the draft's config.json, the float64 HF oracle with its weights).
    A different shape from the target (one KV head, head_dim 8), the target's vocab."""
    vocab = engine_config().model_config.vocab_size
    cfg = LlamaConfig(
        architectures=["LlamaForCausalLM"], hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
        vocab_size=vocab, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    directory = tmp_path_factory.mktemp("draft")
    cfg.save_pretrained(directory)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():  # clear argmax gaps: every weight random, norms around 1
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return str(directory), hf_oracle(hf.eval(), torch.float64)


def make_proposer(draft, backend: str = "TORCH") -> V1DraftProposer:
    directory, oracle = draft
    proposer = V1DraftProposer(
        engine_config(backend), build_model_config(directory, "float64", "cpu", MAX_LEN), K,
        torch.device("cpu"))
    proposer.load_model()
    proposer.executor.model.load_weights(oracle.state_dict().items())
    proposer.initialize_kv_cache(NUM_BLOCKS)
    return proposer


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# ---- the hand-driven runner --------------------------------------------------------------


@dataclass
class Req:
    state: CachedRequestState
    temperature: float
    seed: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    new: bool = True
    drafts: list[int] = field(default_factory=list)  # the latest proposal
    q: np.ndarray | None = None  # the oracle's q of those drafts (random rows)

    @property
    def tokens(self) -> list[int]:
        return self.state.all_token_ids


class Sim:
    def __init__(self, proposer: V1DraftProposer, oracle) -> None:
        self.proposer = proposer
        self.oracle = oracle
        self.vocab = proposer.vocab_size
        self.batch = PersistentBatch(MAX_SEQS, MAX_LEN, MAX_TOKENS, self.vocab, BLOCK, "cpu")
        self.reqs: dict[str, Req] = {}
        self.next_block = 1  # block 0 is never handed out: a zero table entry names it
        self.rng = np.random.default_rng(0)
        self.steps = 0
        self.caps: dict[tuple[str, int], int] = {}  # (request, step) -> drafts proposed
        self.trimmed = 0  # verifications of fewer drafts than were proposed

    def add(self, req_id: str, prompt_len: int, temperature: float = 0.0, seed: int = 0) -> None:
        prompt = self.rng.integers(0, self.vocab, prompt_len).tolist()
        state = CachedRequestState(
            req_id=req_id, prompt_token_ids=prompt, prompt_len=prompt_len,
            sampling_params=SamplingParams(temperature=temperature, seed=seed, max_tokens=64),
            eos_token_id=None, block_ids=[], num_computed_tokens=0)
        self.reqs[req_id] = Req(state, temperature, seed)

    def _allocate(self, req: Req, num_positions: int) -> list[int]:
        need = -(-num_positions // BLOCK) - len(req.blocks)
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        req.blocks += new
        return new

    def step(self, plan: dict[str, tuple[int, int]]) -> None:
        """plan: request -> (n, accepted). A prefilling request schedules n prompt tokens;
        a decoding one its first min(n, proposed) drafts, of which it accepts `accepted`."""
        self.steps += 1
        batch = self.batch
        for req_id in [r for r in batch.req_ids if r not in plan]:
            batch.remove_request(req_id)  # scheduled out: its proposal stays
        num_sched, drafts = self._schedule(plan)
        batch.condense()
        batch.reorder_decodes_first(num_sched)
        metadata = batch.refresh_sampling_metadata()
        batch.block_table.commit(batch.num_reqs)  # prepare_inputs' first act in the runner
        req_ids = list(batch.req_ids)
        num_draft = np.array([len(drafts.get(r, [])) for r in req_ids], dtype=np.int32)
        for row, req_id in enumerate(req_ids):  # V1Speculator.write_drafts' layout
            d, nt = drafts.get(req_id, []), batch.num_tokens[row]
            batch.token_ids[row, nt : nt + len(d)] = d
        self._check_draft_probs(req_ids, num_draft, drafts)
        runs = self._sample(req_ids, num_sched, drafts, plan)
        # the runner's order: launch with the step's tokens on the device (the
        # RejectionOutput layout: each row's run, -1 padded), then append, then collect
        width = max([len(r) for r in runs.values()], default=1)
        new_tokens = torch.full((len(req_ids), width), -1, dtype=torch.int64)
        num_new = torch.zeros(len(req_ids), dtype=torch.int32)
        for row, run in runs.items():
            new_tokens[row, : len(run)] = torch.tensor(run)
            num_new[row] = len(run)
        sched = np.array([num_sched[r] for r in req_ids], dtype=np.int32)
        self.proposer.launch(batch, self._step_tokens(sched), sched, new_tokens, num_new, metadata)
        sampled = sorted(runs)
        for row in sampled:
            nt = batch.num_tokens[row]
            batch.token_ids[row, nt : nt + len(runs[row])] = runs[row]
            batch.num_tokens[row] += len(runs[row])
        proposals = self.proposer.collect(batch, np.array(sampled, dtype=np.int64))
        assert len(proposals) == len(sampled)
        for row, proposal in zip(sampled, proposals):
            self._check_proposal(self.reqs[req_ids[row]], proposal)
        for req_id in req_ids:  # the scheduler's check_stop at max_model_len
            if len(self.reqs[req_id].tokens) >= MAX_LEN:
                batch.remove_request(req_id)
                self.proposer.remove(req_id)
                del self.reqs[req_id]

    def _step_tokens(self, sched: np.ndarray) -> StepTokens:
        """The step's query as the target's forward read it, from the test's own
        bookkeeping (each row's tokens from position num_computed on, its drafts past
        its known tokens)."""
        ids, positions, seq_lens, qsl = [], [], [], [0]
        for row in range(self.batch.num_reqs):
            c = int(self.batch.num_computed_tokens[row])
            n = int(sched[row])
            ids += self.batch.token_ids[row, c : c + n].tolist()  # drafts written past
            positions += list(range(c, c + n))
            seq_lens.append(c + n)
            qsl.append(qsl[-1] + n)
        return StepTokens(torch.tensor(ids, dtype=torch.int32), torch.tensor(positions),
                          torch.tensor(seq_lens, dtype=torch.int32), np.array(qsl))

    def _schedule(self, plan):
        num_sched, drafts = {}, {}
        for req_id, (n, _) in plan.items():
            req = self.reqs[req_id]
            c = req.num_computed
            if req.state.output_token_ids:  # decoding
                d = req.drafts[: min(n, len(req.drafts))]
                self.trimmed += 0 < len(d) < len(req.drafts)
                num_sched[req_id], drafts[req_id] = 1 + len(d), d
                req.drafts = []
            else:
                assert c + n <= req.state.prompt_len
                num_sched[req_id] = n
            lookahead = 0 if req.new else min(K, MAX_LEN - c - num_sched[req_id])
            new_blocks = self._allocate(req, c + num_sched[req_id] + lookahead)
            row = self.batch.req_id_to_index.get(req_id)
            if row is None:
                req.state.num_computed_tokens = c
                req.state.block_ids = list(req.blocks)
                self.batch.add_request(req.state)
            else:
                self.batch.num_computed_tokens[row] = c
                self.batch.block_table.append_row(new_blocks, row)
            req.new = False
        return num_sched, drafts

    def _sample(self, req_ids, num_sched, drafts, plan) -> dict[int, list[int]]:
        """The target's stand-in: accept the plan's number of drafts, then a random token
        (different from the first rejected draft). -> row -> its run (not yet in the
        batch's token table)."""
        runs = {}
        for row, req_id in enumerate(req_ids):
            req, s = self.reqs[req_id], num_sched[req_id]
            d = drafts.get(req_id)
            if d is None and req.num_computed + s < len(req.tokens):
                req.num_computed += s  # a partial prefill chunk samples nothing
                continue
            d = d or []
            a = min(plan[req_id][1], len(d))
            token = int(self.rng.integers(self.vocab))
            while a < len(d) and token == d[a]:
                token = int(self.rng.integers(self.vocab))
            run = d[:a] + [token]
            req.num_computed += s - (len(d) - a)
            req.state.output_token_ids.extend(run)
            runs[row] = run
        return runs

    def _check_draft_probs(self, req_ids, num_draft, drafts) -> None:
        got = self.proposer.draft_probs_for_step(req_ids, num_draft)
        pieces, any_random = [], False
        for req_id in req_ids:
            d = drafts.get(req_id, [])
            if not d:
                continue
            req = self.reqs[req_id]
            if req.q is not None:
                any_random = True
                pieces.append(req.q[: len(d)])
            else:
                pieces.append(np.eye(self.vocab)[d])
        if not any_random:
            assert got is None
            return
        np.testing.assert_allclose(got.numpy(), np.concatenate(pieces), rtol=0, atol=1e-12)

    def _check_proposal(self, req: Req, proposal: list[int]) -> None:
        tokens, known = req.tokens, len(req.tokens)
        cap = max(0, min(K, MAX_LEN - known - 1, len(req.blocks) * BLOCK - known + 1))
        self.caps[(req.state.req_id, self.steps)] = len(proposal)
        assert len(proposal) == cap, (req.state.req_id, self.steps)
        req.drafts = proposal
        req.q = None
        if req.temperature == 0:  # greedy: the oracle decodes autoregressively
            expected = []
            for _ in range(cap):
                expected.append(int(hf_logits(self.oracle, tokens + expected)[-1].argmax()))
            assert proposal == expected, (req.state.req_id, self.steps)
            assert self.proposer.draft_probs_for_step([req.state.req_id], np.array([cap])) is None
            return
        q = []
        temperature = float(np.float32(req.temperature))  # as the sampler receives it
        for j in range(cap):  # random: Gumbel-max on the oracle's logits, in NumPy
            logits = hf_logits(self.oracle, tokens + proposal[:j])[-1].numpy()
            # the draft's own noise: the seed salted, keyed by the proposal's first
            # position x 32 + the draft's index (shared/sampling/draft_sampling.py)
            noise = reference_noise(req.seed ^ DRAFT_SALT, (known - 1) * 32 + j,
                                    np.arange(len(logits)))
            expected = int(np.argmax(logits / temperature + noise))
            assert expected == proposal[j], (req.state.req_id, self.steps, j)
            q.append(softmax(logits / temperature))
        if cap:
            req.q = np.stack(q)
            got = self.proposer.draft_probs_for_step([req.state.req_id], np.array([cap]))
            np.testing.assert_allclose(got.numpy(), req.q, rtol=0, atol=1e-12)


# Step plans: request -> (prompt tokens to schedule | drafts to schedule, drafts accepted).
PLAN = [
    # a: prompt 8 = 2 blocks, new: its new token's slot is not allocated -> no drafts;
    # b: a partial prefill; d: 30 tokens, its lookahead-less blocks hold 1 more position.
    {"a": (8, 0), "b": (6, 0), "c": (5, 0), "d": (30, 0)},
    {"a": (3, 0), "b": (7, 0), "c": (3, 1), "d": (2, 2), "e": (11, 0)},
    {"a": (3, 3), "b": (3, 0), "c": (2, 0), "d": (3, 2), "e": (3, 1)},
    {"a": (1, 0), "b": (3, 3), "d": (2, 1), "e": (3, 2)},  # c is scheduled out
    {"c": (3, 3), "a": (3, 1), "b": (3, 2), "d": (0, 0), "e": (3, 0)},  # d finishes
    {"a": (3, 2), "b": (3, 1), "c": (3, 2), "e": (3, 3), "f": (1, 0)},
    {"a": (3, 0), "b": (3, 3), "c": (3, 1), "e": (3, 2), "f": (5, 0)},
]


def run_scenario(proposer: V1DraftProposer, oracle) -> Sim:
    sim = Sim(proposer, oracle)
    for req_id, prompt_len, temperature, seed in [
        ("a", 8, 0.0, 0), ("b", 13, 0.0, 0), ("c", 5, 0.8, 123), ("d", 30, 0.0, 0),
        ("e", 11, 1.5, 7), ("f", 6, 0.0, 0),
    ]:
        sim.add(req_id, prompt_len, temperature, seed)
    for plan in PLAN:
        sim.step(plan)
    return sim


# TRITON (the GPU default, interpreted here) reads num_decodes: step 6's one-token prefill
# chunk is a leading length-1 row of the catch-up, the single-token forwards are all decodes.
@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_drafts_match_the_from_scratch_oracle(draft, backend):
    proposer = make_proposer(draft, backend)
    sim = run_scenario(proposer, draft[1])
    caps = sim.caps
    # the scenario reaches what it claims: the allocation cap (0 and partial), the
    # max_model_len cap (partial and 0), full proposals, a trimmed verification
    assert caps[("a", 1)] == 0 and caps[("d", 1)] == 2 and caps[("e", 2)] == 1
    assert caps[("d", 3)] == 2 and caps[("d", 4)] == 0
    assert caps[("c", 5)] == K and caps[("f", 7)] == K and sim.trimmed > 0
    assert "d" not in sim.reqs  # finished at max_model_len
    # nothing was written outside the blocks handed out (block 0 included)
    unused = [b for b in range(NUM_BLOCKS) if b == 0 or b >= sim.next_block]
    for kv in proposer.executor.kv_caches:
        assert kv[:, unused].abs().max().item() == 0.0


def test_remove_and_reset_forget_the_proposals(draft):
    proposer = make_proposer(draft)
    sim = Sim(proposer, draft[1])
    sim.add("r", 6, 0.7, 5)
    sim.add("g", 9, 0.0, 0)
    sim.step({"r": (6, 0), "g": (9, 0)})
    assert sim.reqs["r"].drafts and sim.reqs["g"].drafts
    counts = np.array([1, 1], dtype=np.int32)
    assert proposer.draft_probs_for_step(["g", "r"], counts).shape == (2, proposer.vocab_size)
    proposer.remove("r")
    with pytest.raises(RuntimeError, match="'r' is scheduled with 1 drafts"):
        proposer.draft_probs_for_step(["g", "r"], counts)
    proposer.reset()
    with pytest.raises(RuntimeError, match="'g'"):
        proposer.draft_probs_for_step(["g"], np.array([1]))


def test_set_up_hooks(draft):
    directory, _ = draft
    proposer = make_proposer(draft)
    # the draft's own KV layout: layers x K and V x block x kv heads x head_dim x float64
    assert proposer.kv_bytes_per_block() == 2 * 2 * BLOCK * 1 * 8 * 8
    called = []
    proposer.profile_run(then=lambda: called.append(True))
    assert called == [True]
    for kv in proposer.executor.kv_caches:  # the profile forward touches no KV
        assert kv.abs().max().item() == 0.0
    wrong = build_model_config(directory, "float64", "cpu", MAX_LEN).model_copy(
        update={"vocab_size": 100})
    with pytest.raises(ValueError, match="vocab_size=100"):
        V1DraftProposer(engine_config(), wrong, K, torch.device("cpu"))
