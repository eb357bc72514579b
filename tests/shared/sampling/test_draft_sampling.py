"""sample_draft (shared/sampling/draft_sampling.py), the draft model's sampling both runners
call, against oracles it does not share: NumPy's softmax for q, the NumPy noise reference
for each token's key and salt, and chi-square tests of the token counts that reject a draw
from the wrong distribution (the temperature ignored) and noise shared with the target's
draw (the salt left out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.sampling.draft_sampling import sample_draft
from shared.sampling.noise import DRAFT_SALT, gumbel_noise
from tests.oracles.sampling_reference import reference_noise
from tests.oracles.spec_chain import chi_square_pvalue

LOGITS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, -1.0])
T = 0.8
T32 = float(np.float32(T))  # a request's temperature reaches the sampler as float32
N = 20_000
# the key of draft `index`: its proposal's first position x 32 + index (the module's spec)
STRIDE = 32


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


Q = _softmax(LOGITS / T32)


def _draw(seeds: torch.Tensor, first: torch.Tensor, index: int = 0):
    n = len(seeds)
    logits = torch.tensor(LOGITS, dtype=torch.float64).expand(n, -1).contiguous()
    return sample_draft(logits, torch.full((n,), T, dtype=torch.float32), seeds, first, index)


def _counts(tokens: np.ndarray) -> dict[int, int]:
    values, counts = np.unique(tokens, return_counts=True)
    return dict(zip(values.tolist(), counts.tolist(), strict=True))


def _pvalue(tokens: np.ndarray, probs: np.ndarray) -> float:
    return chi_square_pvalue(_counts(tokens), dict(enumerate(probs.tolist())), len(tokens))


def test_q_is_softmax_of_the_scaled_logits() -> None:
    _, q = _draw(torch.arange(4), torch.zeros(4, dtype=torch.int64))
    np.testing.assert_allclose(q.numpy(), np.broadcast_to(Q, (4, len(Q))), rtol=0, atol=1e-15)


@pytest.mark.parametrize("index", [0, 3])
def test_each_token_is_the_gumbel_max_of_its_salted_key(index: int) -> None:
    """Row by row against the NumPy noise under seed ^ DRAFT_SALT at first * 32 + index;
    a greedy row takes the argmax."""
    seeds = torch.tensor([0, 1, 7, 2**40 + 5, 123456789])
    first = torch.tensor([0, 3, 17, 1000, 65535])
    temperature = torch.tensor([T, T, 0.0, 1.5, T], dtype=torch.float32)
    logits = torch.tensor(np.random.default_rng(0).normal(size=(5, 50)))
    tokens, _ = sample_draft(logits, temperature, seeds, first, index)
    vocab = np.arange(50)
    for r in range(5):
        x, t = logits[r].numpy(), float(temperature[r])
        if t == 0:
            expected = int(x.argmax())
        else:
            noise = reference_noise(int(seeds[r]) ^ DRAFT_SALT, int(first[r]) * STRIDE + index,
                                    vocab)
            expected = int(np.argmax(x / t + noise))
        assert int(tokens[r]) == expected, r


def test_the_tokens_are_distributed_as_q() -> None:
    seeds, first = torch.arange(N), torch.full((N,), 7, dtype=torch.int64)
    tokens, _ = _draw(seeds, first)
    assert _pvalue(tokens.numpy(), Q) > 1e-3
    # the test's teeth: the same noise over the unscaled logits is a draw from softmax(x),
    # not from the q the rejection sampler is told
    noise = gumbel_noise(seeds ^ DRAFT_SALT, first * STRIDE, len(LOGITS))
    wrong = (noise + torch.tensor(LOGITS)).argmax(dim=-1).numpy()
    assert _pvalue(wrong, Q) < 1e-6


def test_the_draft_noise_is_independent_of_the_targets() -> None:
    """The target samples at the same (seed, key) with the unsalted noise. Independent
    draws of q agree with probability sum(q^2) (about a third here); with the salt left
    out the draft would be the target's own draw and agree always."""
    seeds, first = torch.arange(N), torch.full((N,), 7, dtype=torch.int64)
    keys = first * STRIDE
    tokens, _ = _draw(seeds, first)
    scaled = torch.tensor(LOGITS / T32)
    target = (gumbel_noise(seeds, keys, len(LOGITS)) + scaled).argmax(dim=-1)
    agree = float((tokens == target).double().mean())
    p = float((Q**2).sum())
    assert abs(agree - p) < 5 * np.sqrt(p * (1 - p) / N), (agree, p)
