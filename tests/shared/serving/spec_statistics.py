"""The oracle of the spec-decode distribution tests (CPU: test_spec_decode_statistics.py;
GPU: tests/gpu/shared/serving/test_spec_decode_statistics_gpu.py).

One prompt, one request per seed, temperature 0.1 (the random model's logits are flat:
this puts about four fifths of each step's mass on its top three tokens) and four output
tokens. Transformers gives, in float64, the exact probability of every chain of each
context's top 4 tokens (the chain rule); all other outputs share one cell, "rest". The
engine's counts are compared with them by a chi-square test at a fixed significance.

With the target's own weights as the draft, q equals p and every draft is accepted; a
rejection sampler told a wrong q (the distortion below: q^0.7, renormalised, while the
drafts still come from q) rejects tail tokens it should keep and moves their mass to the
top ones, which must fail the test: its teeth. A draft model that disagrees with the
target exercises the residual instead."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.contract.sampling_params import SamplingParams
from shared.harness.diff import DiffSetup, build_engine
from tests.oracles.hf_float64 import hf_logits, hf_oracle

PROMPT = [5, 6, 7, 8]
TEMPERATURE = 0.1
TOP = 4  # tokens per context the oracle enumerates; beyond them, the "rest" cell
MAX_TOKENS = 4
REST = "rest"
WEAK = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": 2}
ALPHA = 1e-4  # a correct sampler fails once in 10,000 runs
TEETH = 1e-6  # the distorted one must be rejected far beyond it


def target_probs(checkpoint: str) -> dict:
    """P(t1..t4) for every chain of top-4 tokens, and P(rest) for all other outputs."""
    from transformers import AutoModelForCausalLM

    hf = hf_oracle(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64),
                   torch.float64)
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(MAX_TOKENS):
        nxt = {}
        for prefix, p in probs.items():
            logits = hf_logits(hf, PROMPT + list(prefix))[-1].numpy()
            scaled = logits / TEMPERATURE
            e = np.exp(scaled - scaled.max())
            q = e / e.sum()
            for token in np.argsort(q)[-TOP:].tolist():
                nxt[prefix + (token,)] = p * q[token]
        probs = nxt
    probs[REST] = 1.0 - sum(probs.values())
    return probs


def cell(output: tuple[int, ...], target: dict):
    return output if output in target else REST


def sampled_counts(setup: DiffSetup, runner: str, spec: dict, n: int, target: dict):
    """-> ({cell: count} over n seeded requests, the engine's SpecDecodeStats)."""
    engine = build_engine(setup, runner, dict(
        max_model_len=16, max_num_seqs=256, max_num_batched_tokens=2048,
        num_gpu_blocks_override=512, enable_prefix_caching=False, speculative_config=spec))
    for i in range(n):
        engine.add_request(str(i), PROMPT, SamplingParams(
            max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=i, ignore_eos=True))
    counts: dict[tuple[int, ...], int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert len(out.outputs[0].token_ids) == MAX_TOKENS
                key = cell(tuple(out.outputs[0].token_ids), target)
                counts[key] = counts.get(key, 0) + 1
    assert sum(counts.values()) == n
    return counts, engine.spec_decode_stats


def distort_draft_probs(monkeypatch: pytest.MonkeyPatch, runner_module) -> None:
    """The runner's drafts still come from q, but the q it reports is bent: a rejection
    sampler that trusts it no longer samples the target."""
    real = runner_module.sample_draft

    def bent(*args, **kwargs):
        tokens, q = real(*args, **kwargs)
        if q is not None:
            q = q**0.7
            q = q / q.sum(dim=-1, keepdim=True)
        return tokens, q

    monkeypatch.setattr(runner_module, "sample_draft", bent)


def draft_config(draft: str, target_checkpoint: str) -> dict:
    """"weak": another random model (tiny-llama-draft); "self": the target's checkpoint."""
    return WEAK if draft == "weak" else {**WEAK, "model": target_checkpoint}
