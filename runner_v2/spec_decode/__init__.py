"""V2 speculative decoding: drafts on the device, rejection sampling in Triton."""
