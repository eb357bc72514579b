"""The step contract between the scheduler and a model runner (DESIGN.md §3).

The scheduler hands a runner one `SchedulerOutput` per step; the runner returns one
`ModelRunnerOutput`. Both runners see exactly the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.contract.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the batch: fresh, or resumed after preemption.

    A resumed request comes back as new with its generated tokens appended to
    `prompt_token_ids`; `prompt_len` still names the user prompt's length so that
    penalties and min_tokens count the resumed outputs as outputs.
    """

    req_id: str
    prompt_token_ids: list[int]  # the prefill: prompt plus tokens generated before preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # > 0 after a prefix-cache hit
    prompt_len: int  # length of the user prompt (<= len(prompt_token_ids))
    # The samplers mask EOS while fewer than min_tokens outputs exist (None: no EOS).
    eos_token_id: int | None = None
    # A pooling engine's request (shared/contract/pooling.py PoolingParams): the runner
    # pools its prompt instead of sampling; None otherwise.
    pooling_params: Any = None

    @property
    def prefill_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class CachedRequestData:
    """Requests that were in the batch last step and are scheduled again."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step's tokens

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens scheduled this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished and aborted since the last step
    preempted_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: req_id -> the draft tokens scheduled after its last sampled
    # token this step (they are counted in num_scheduled_tokens: 1 + len(drafts) for a
    # decode). -1 entries are drafts whose values live on the device (V2's draft model).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled position: the sampled token first, then the top-k
    requested tokens, each with its log-probability under the raw model logits."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the sampled token among all tokens (1 = most likely)


@dataclass
class PromptLogprobs:
    """The prompt logprobs one step computed for one request: rows for the prompt
    positions [start, start + len(ranks)), each the logprob of the prompt token at that
    position given the tokens before it (position 0 has none: start >= 1)."""

    start: int
    token_ids: list[list[int]]  # per row: the prompt token, then the top-k ids
    logprobs: list[list[float]]  # aligned with token_ids
    ranks: list[int]  # rank of the prompt token (1 = most likely)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # batch order of this step
    req_id_to_index: dict[str, int]
    # [] for a partial prefill chunk; with speculative decoding the accepted drafts and
    # the target's own token (1 .. 1 + num drafts tokens)
    sampled_token_ids: list[list[int]]
    # aligned with req_ids; an entry is None when not requested or nothing was sampled
    logprobs: list[TokenLogprobs | None] | None = None
    # req_id -> this step's prompt logprobs (requests with SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    pooler_output: list[object] | None = None
    # Speculative decoding: aligned with req_ids, the drafts proposed for each request's
    # next step ([] for none; -1 entries when the values stay on the device). None when
    # the runner proposes nothing.
    draft_token_ids: list[list[int]] | None = None

    @staticmethod
    def empty() -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput.empty()
