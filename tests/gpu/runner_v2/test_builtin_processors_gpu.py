"""The built-in logits processors compiled on CUDA (GPU machine only): the interpreter
tests of tests/runner_v2/test_builtin_processors.py on the device (the barrier between
the allowed-ids restore and the bias, the word tiles, the UVA token table), a larger
vocabulary, and no host sync in a sampler call with every built-in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.contract.sampling_params import SamplingParams
from tests.runner_v1.test_sampler import Row
from tests.runner_v2.test_builtin_processors import (
    FEATURES,
    Harness,
    assert_matches_oracle,
    builtin_case,
    ranked_logits,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("feature", FEATURES)
def test_builtins_match_oracle_on_cuda(feature: str, dtype: torch.dtype) -> None:
    reqs, logits = builtin_case(feature, dtype)
    h = Harness(device="cuda")
    rows = h.add_all(reqs)
    assert_matches_oracle(h, rows, logits.cuda())


def test_decode_steps_on_cuda() -> None:
    h = Harness(device="cuda")
    alternate = Row(SamplingParams(seed=1, temperature=0.0, bad_words_token_ids=[[40, 40]]),
                    [1, 2], [])
    rows = h.add_all([alternate])
    logits = ranked_logits(1, [40, 41]).cuda()
    for _ in range(4):
        tokens = assert_matches_oracle(h, rows, logits)
        h.post_update(rows, torch.tensor(tokens, dtype=torch.int64))
    assert alternate.outputs == [40, 41, 40, 41]


def test_large_vocab_and_no_sync_on_cuda() -> None:
    vocab = 32_000
    rng = np.random.default_rng(3)
    h = Harness(vocab=vocab, device="cuda")
    reqs = []
    for i in range(6):
        outputs = rng.integers(0, vocab, 12).tolist()
        sp = SamplingParams(
            seed=i, temperature=0.0 if i % 2 else 0.9, repetition_penalty=1.2,
            allowed_token_ids=rng.choice(vocab, 1000, replace=False).tolist(),
            logit_bias={int(t): 5.0 for t in rng.choice(vocab, 1000, replace=False)},
            bad_words_token_ids=[outputs[-3:] + [int(t)] for t in rng.integers(0, vocab, 100)],
        )
        reqs.append(Row(sp, rng.integers(0, vocab, 20).tolist(), outputs))
    rows = h.add_all(reqs)
    logits = torch.from_numpy(rng.normal(0, 3, (len(rows), vocab))).float().cuda()
    assert_matches_oracle(h, rows, logits)
    idx_np = np.asarray(rows, np.int32)
    idx = torch.from_numpy(idx_np).cuda()
    positions = torch.tensor([h.reqs[r].pos for r in rows], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        h.sampler(logits, idx, positions, None, idx_mapping_np=idx_np)
    finally:
        torch.cuda.set_sync_debug_mode("default")
