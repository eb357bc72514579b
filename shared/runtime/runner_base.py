"""The set-up half of the runner protocol, identical in both runners.

Both runners own a ModelExecutor (model, attention backend, KV cache) and a StageTimer;
load_model / determine_num_blocks / initialize_kv_cache / step_stats only delegate to
them. The step half (execute_model, sample_tokens, capture_model) is each runner's own.
"""

from __future__ import annotations

import logging

import torch

from shared.model.pooler import PromptPooler
from shared.runtime.model_executor import ModelExecutor
from shared.runtime.step_timing import StageTimer, StepStats

logger = logging.getLogger("runnerlab")


class RunnerSetupMixin:
    executor: ModelExecutor
    timer: StageTimer
    device: torch.device
    max_num_tokens: int
    max_num_reqs: int

    # A runner's speculative-decoding part (or None); it may own a draft model whose KV
    # cache shares the target's block layout (shared/runtime/draft_executor.py).
    speculator = None
    # A pooling engine's pooler (shared/model/pooler.py), built with the model: the runner
    # then pools the prompt's hidden states instead of sampling.
    pooler: PromptPooler | None = None

    def load_model(self) -> None:
        self.executor.load_model()
        if self.speculator is not None:
            self.speculator.load_model()
        settings = getattr(self.config, "pooler_config", None)
        if settings is not None:
            self.pooler = PromptPooler(settings, self.executor.model)
            logger.info(
                "Pooling: task %s, %s pooling, head %s; every step is a prefill, run eagerly "
                "or in piecewise graphs (no FULL graphs: no uniform decode batch ever runs)",
                settings.task, settings.pooling_type, settings.head)

    def determine_num_blocks(self) -> int:
        extra = 0 if self.speculator is None else self.speculator.kv_bytes_per_block()
        return self.executor.determine_num_blocks(self._profile_run, extra)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.executor.initialize_kv_cache(num_blocks)
        if self.speculator is not None:
            self.speculator.initialize_kv_cache(num_blocks)

    @property
    def step_stats(self) -> StepStats:
        return self.timer.stats

    def _profile_run(self) -> None:
        """The largest forward the engine will run (token budget, then the logits of a
        full batch), without attention metadata, so no KV cache is touched."""
        n = self.max_num_tokens
        ids = torch.zeros(n, dtype=torch.int32, device=self.device)
        pos = torch.arange(n, dtype=torch.int64, device=self.device) % 16
        hidden = self.executor.forward(ids, pos, None, n)
        if self.pooler is None:
            self.executor.compute_logits(hidden[: self.max_num_reqs])
        elif self.pooler.settings.head != "hidden":  # a classifier has no LM head
            self.executor.model.pooler_head(hidden)
