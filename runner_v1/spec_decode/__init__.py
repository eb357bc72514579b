"""V1 speculative decoding."""
