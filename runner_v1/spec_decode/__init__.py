"""V1 speculative decoding: the rejection sampler (standard and synthetic verification)."""

from runner_v1.spec_decode.rejection_sampler import METHODS, rejection_sample

__all__ = ["METHODS", "rejection_sample"]
