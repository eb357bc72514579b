"""LLM's pooling methods (vLLM's names): encode, embed, classify, score. The LLM's
engine must have been created for the task (EngineArgs.pooling_task): one engine runs
one pooling task, as a vLLM pooling runner does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shared.contract.pooling import (
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringRequestOutput,
)


class PoolingAPI:
    """Mixed into LLM; uses its engine, _tokenize, _add_all and _run."""

    engine: Any

    def encode(self, prompts: Any, pooling_task: str | None = None,
               pooling_params: PoolingParams | None = None,
               use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        """Every prompt through the engine's pooling task; outputs in prompt order."""
        from shared.serving.engine import EngineInputError
        from shared.serving.llm import normalize_prompts

        engine_task = self.engine.pooling_task
        wanted = pooling_task or (pooling_params.task if pooling_params else None) or engine_task
        if engine_task is None or wanted != engine_task:
            raise EngineInputError(
                f"pooling task {wanted!r} needs an LLM created with pooling_task={wanted!r}; "
                f"this one runs {'generation' if engine_task is None else repr(engine_task)}"
            )
        prompts = normalize_prompts(prompts)
        params = pooling_params or PoolingParams(task=wanted)
        return self._run_pooling(prompts, [params] * len(prompts), use_tqdm)

    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        return self.encode(prompts, "embed", pooling_params, use_tqdm)

    def classify(self, prompts: Any, pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        return self.encode(prompts, "classify", pooling_params, use_tqdm)

    def score(self, a: Any, b: Any, use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """One score per pair (a_i, b_i); a single `a` is paired with every `b`. On a model
        without a classification head: the cosine similarity of the two embeddings. On a
        sequence classifier: its output for the pair (a's tokens then b's; with a
        tokenizer, its pair encoding), a probability vector (one value for one label)."""
        from shared.serving.engine import EngineInputError
        from shared.serving.llm import normalize_prompts

        if self.engine.pooling_task != "score":
            raise EngineInputError(
                "LLM.score needs an LLM created with pooling_task='score'; this one runs "
                f"{self.engine.pooling_task or 'generation'!r}"
            )
        left, right = normalize_prompts(a), normalize_prompts(b)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right):
            raise EngineInputError(
                f"LLM.score got {len(left)} texts a and {len(right)} texts b; pass one a, or "
                "as many as b")
        settings = self.engine.config.pooler_config
        params = PoolingParams(task="score")
        if settings.head == "sequence_classifier":
            pairs = [self._pair_ids(x, y) for x, y in zip(left, right)]
            outs = self._run_pooling(pairs, [params] * len(pairs), use_tqdm)
            return [ScoringRequestOutput(o.request_id, PoolingOutput(o.outputs.data.squeeze()))
                    for o in outs]
        emb = self._run_pooling(left + right, [params] * (2 * len(left)), use_tqdm)
        n = len(left)
        return [ScoringRequestOutput(
            f"{emb[i].request_id}-{emb[i + n].request_id}",
            PoolingOutput(torch.nn.functional.cosine_similarity(
                emb[i].outputs.data, emb[i + n].outputs.data, dim=0)))
            for i in range(n)]

    def _pair_ids(self, x: Any, y: Any) -> list[int]:
        if isinstance(x, str) and isinstance(y, str) and self.engine.tokenizer is not None:
            return list(self.engine.tokenizer(x, y)["input_ids"])
        return list(self._tokenize(x)) + list(self._tokenize(y))

    def _run_pooling(self, prompts: Sequence[Any], params: Sequence[PoolingParams],
                     use_tqdm: bool) -> list[PoolingRequestOutput]:
        return self._run(self._add_all(prompts, params), prompts, use_tqdm)
