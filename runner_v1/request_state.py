"""The runner's own record of a request (`CachedRequestState`), kept for the request's
whole life so that V1's persistent batch (runner_v1.persistent_batch) can put it back
into a row after it was scheduled out."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from shared.contract.sampling_params import SamplingParams
from shared.contract.step import NewRequestData


@dataclass
class CachedRequestState:
    """The runner's own copy of a request, kept while the request lives (also while it
    is scheduled out of the batch), so that it can be put back into a row."""

    req_id: str
    prompt_token_ids: list[int]  # the prefill: user prompt + outputs from before a preemption
    prompt_len: int  # the user prompt's length; penalties / min_tokens count the rest as output
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    # None -> the resumed outputs inside the prefill. The runner appends sampled tokens.
    output_token_ids: list[int] | None = None
    # None -> sampling_params.seed, else a random seed drawn once and kept with the request.
    seed: int | None = None

    def __post_init__(self) -> None:
        resumed = self.prompt_token_ids[self.prompt_len :]
        if self.output_token_ids is None:
            self.output_token_ids = list(resumed)
        elif self.output_token_ids[: len(resumed)] != resumed:
            raise ValueError(
                f"request {self.req_id!r}: output_token_ids must start with the resumed "
                "outputs carried in prompt_token_ids[prompt_len:]"
            )
        if self.seed is None:
            # The engine assigns seeds at admission; this keeps a direct caller working.
            seed = self.sampling_params.seed
            self.seed = seed if seed is not None else secrets.randbits(63)

    @classmethod
    def from_new_request(
        cls, new_req: NewRequestData, eos_token_id: int | None
    ) -> CachedRequestState:
        return cls(
            req_id=new_req.req_id,
            prompt_token_ids=list(new_req.prompt_token_ids),
            prompt_len=new_req.prompt_len,
            sampling_params=new_req.sampling_params,
            eos_token_id=eos_token_id,
            block_ids=list(new_req.block_ids),
            num_computed_tokens=new_req.num_computed_tokens,
        )

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids[: self.prompt_len] + self.output_token_ids
