"""V1 speculative decoding: spec-decode metadata, rejection sampling, proposers."""
