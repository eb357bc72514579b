"""runner_v1/tp_sampling.py: under tensor parallelism V1's rank 0 samples and the other
ranks receive exactly its result (every field, dtype and shape), without sampling."""

import torch

from runner_v1.tp_sampling import RankZeroSampling
from shared.contract.sampler_output import RejectionOutput, SamplerOutput
from shared.distributed.group import SINGLE
from tests.oracles.gloo_world import run_ranks


def _sampler_output(seed: int) -> SamplerOutput:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (5,), generator=g)
    return SamplerOutput(tokens, torch.randint(0, 1000, (5, 3), generator=g),
                         torch.randn(5, 3, generator=g, dtype=torch.float64),
                         torch.randint(1, 9, (5,), generator=g))


def _rejection_output(seed: int) -> RejectionOutput:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, 50, (4, 4), generator=g)
    return RejectionOutput(ids[:, :3], torch.randint(1, 4, (4,), generator=g, dtype=torch.int32))


def _ranks_main(group):
    sampling = RankZeroSampling(group, torch.device("cpu"))
    calls = []

    def sample(make, seed):
        calls.append(seed)
        return make(seed + group.rank)  # a rank that sampled would return its own values

    a = sampling.run(lambda: sample(_sampler_output, 1))
    b = sampling.run(lambda: sample(lambda s: SamplerOutput(torch.arange(3) + s, None, None,
                                                            None), 7))
    c = sampling.run(lambda: sample(_rejection_output, 3))  # a non-contiguous field too
    return calls, a, b, c


def test_rank_zero_samples_and_the_others_receive_it():
    (calls0, *outs0), (calls1, *outs1) = run_ranks(_ranks_main, 2)
    assert calls0 == [1, 7, 3] and calls1 == []
    for got, want in zip(outs1, [_sampler_output(1), SamplerOutput(torch.arange(3) + 7, None,
                                                                   None, None),
                                 _rejection_output(3)]):
        assert type(got) is type(want)
        for name in want.__dataclass_fields__:
            w, g = getattr(want, name), getattr(got, name)
            if w is None:
                assert g is None
            else:
                assert g.dtype == w.dtype and torch.equal(g, w), name


def test_a_single_rank_just_samples():
    out = RankZeroSampling(SINGLE, torch.device("cpu")).run(lambda: _sampler_output(5))
    assert torch.equal(out.sampled_token_ids, _sampler_output(5).sampled_token_ids)
