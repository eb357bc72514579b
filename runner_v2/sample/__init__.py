"""V2's Triton sampler: SamplingStates (per-state-row params on the device), the
kernels (built-in logits processors: logit_bias (with allowed_token_ids) and
bad_words; penalties, top_k_top_p, gumbel, logprobs) and the Sampler entry point."""

from runner_v2.sample.batch_flags import BatchFlags
from runner_v2.sample.sampler import Sampler
from runner_v2.sample.states import SamplingStates

__all__ = ["BatchFlags", "Sampler", "SamplingStates"]
