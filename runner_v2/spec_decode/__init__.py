"""V2 speculative decoding: the Triton rejection sampler (standard, synthetic and block
verification)."""

from runner_v2.spec_decode.rejection_sampler import METHODS, rejection_sample

__all__ = ["METHODS", "rejection_sample"]
