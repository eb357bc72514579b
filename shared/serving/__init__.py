"""Serving, above the runners: requests, the KV block manager, the scheduler, the engine
(which reaches the selected runner only through the policy's class path), the LLM facade
and the tokenizer."""
