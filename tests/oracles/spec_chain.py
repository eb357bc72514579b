"""A tiny-vocabulary Markov chain and the chi-square test that speculative decoding
samples it: the oracle of the rejection samplers' statistical tests (V1, V2, the GPU and
the engine-level ones).

The chain: target P[prev] and draft Q[prev], Q != P. Many runs (one seed each) generate
LENGTH tokens from a fixed start token by repeated speculative steps: K draft tokens
sampled from Q (numpy's generator, independent of the samplers' noise), verified by the
sampler under test, the output appended. The runs of one step are one batch. The
empirical distribution of the LENGTH-token sequence is compared with the exact chain
distribution by a chi-square test. Everything is seeded, so an outcome is reproducible;
ALPHA bounds the chance that a correct sampler fails.

Without scipy (not installed here), the chi-square survival function is the
Wilson-Hilferty approximation (chi2/df)^(1/3) ~ Normal(1 - 2/(9 df), 2/(9 df)), accurate
to a few percent of p at the df used (30..63), far more than the margin between ALPHA
and the p-values of the deliberately wrong rules (< 1e-8).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared.contract.sampling_params import SamplingParams
from tests.oracles.rejection_reference import SpecRequest, reference_rejection_sample

ALPHA = 1e-3  # a correct sampler passes unless p < ALPHA
WRONG = 1e-6  # a wrong rule must be rejected at least this clearly
LENGTH = 3
K = 2
START = 0
PROMPT_POS = 7  # the position of the start token
Verify = Callable[[list[SpecRequest]], list[list[int]]]


@dataclass(frozen=True)
class Chain:
    p: np.ndarray  # [V, V] target transitions
    q: np.ndarray  # [V, V] draft transitions

    @property
    def vocab(self) -> int:
        return self.p.shape[0]

    def sequence_probs(self, length: int) -> dict[tuple[int, ...], float]:
        out = {}
        for seq in itertools.product(range(self.vocab), repeat=length):
            prev, pr = START, 1.0
            for t in seq:
                pr, prev = pr * self.p[prev, t], t
            out[seq] = pr
        return out


def make_chain(vocab: int = 4, seed: int = 5) -> Chain:
    rng = np.random.default_rng(seed)
    return Chain(rng.dirichlet(np.full(vocab, 2.0), vocab), rng.dirichlet(np.full(vocab, 2.0), vocab))


def simulate(chain: Chain, verify: Verify, runs: int, seed: int = 1, length: int = LENGTH,
             k: int = K, with_q: bool = True) -> np.ndarray:
    """int64 [runs, length]: the first `length` tokens each run generated."""
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**63, runs)
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=length + k)
    gen: list[list[int]] = [[] for _ in range(runs)]
    while True:
        active = [i for i in range(runs) if len(gen[i]) < length]
        if not active:
            return np.array([g[:length] for g in gen])
        ctx = np.empty((len(active), k + 1), dtype=np.int64)
        ctx[:, 0] = [gen[i][-1] if gen[i] else START for i in active]
        for j in range(k):  # draft tokens from Q, by inverse CDF
            cdf = chain.q[ctx[:, j]].cumsum(axis=1)
            ctx[:, j + 1] = np.minimum((rng.random(len(active))[:, None] > cdf).sum(1),
                                       chain.vocab - 1)
        reqs = []
        for row, i in zip(ctx, active):
            pos = PROMPT_POS + len(gen[i])
            reqs.append(SpecRequest(np.log(chain.p[row]), sp, int(seeds[i]),
                                    list(range(pos, pos + k + 1)), row[1:].tolist(),
                                    chain.q[row[:k]] if with_q else None))
        for i, out in zip(active, verify(reqs)):
            gen[i] += out


def chi_square_sf(x: float, df: int) -> float:
    """P(chi2_df >= x), Wilson-Hilferty (module docstring)."""
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi_square_pvalue(observed: dict, expected_probs: dict, total: int,
                      min_expected: float = 5.0) -> float:
    """Pearson's test; cells expected below min_expected are pooled into one."""
    stat, cells, pool_e, pool_o = 0.0, 0, 0.0, 0
    for key, pr in expected_probs.items():
        e, o = total * pr, observed.get(key, 0)
        if e < min_expected:
            pool_e, pool_o = pool_e + e, pool_o + o
            continue
        stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pool_e > 0:
        stat, cells = stat + (pool_o - pool_e) ** 2 / pool_e, cells + 1
    return chi_square_sf(stat, cells - 1)


def sequence_pvalue(chain: Chain, seqs: np.ndarray) -> float:
    observed: dict[tuple[int, ...], int] = {}
    for s in map(tuple, seqs.tolist()):
        observed[s] = observed.get(s, 0) + 1
    return chi_square_pvalue(observed, chain.sequence_probs(seqs.shape[1]), len(seqs))


def reference_verify(method: str) -> Verify:
    return lambda reqs: [reference_rejection_sample(r, method) for r in reqs]


def synthetic_pvalue(counts: np.ndarray, rates: tuple[float, ...], k: int) -> float:
    """Acceptance lengths 0..k against P(n = j) = prod_{i<j} r_i * (1 - r_j)."""
    probs, alive = {}, 1.0
    for j in range(k):
        probs[j], alive = alive * (1 - rates[j]), alive * rates[j]
    probs[k] = alive
    observed = {j: int(c) for j, c in enumerate(counts)}
    return chi_square_pvalue(observed, probs, int(counts.sum()))
