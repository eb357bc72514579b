"""Classification models on the Llama-family decoders: Llama/Qwen2/Qwen3
ForSequenceClassification and ForTokenClassification, loaded from the checkpoints
transformers writes (`model.*` + `score.weight`, plus `score.bias` for token classification).

Each class is its causal LM class with the LM head replaced by the score head: a mixin,
first in the bases, overrides the `_make_head` hook (so no vocab-sized matrix is ever
allocated). The decoder body, its attention options, the piecewise split and the weight
renaming stay the causal LM's own. forward() returns the final-normed hidden states
[T, hidden] exactly as the causal LM's does; the pooler picks the rows it needs and calls
`pooler_head` on them:

- sequence classification (transformers' GenericForSequenceClassification): score =
  Linear(hidden, num_labels, bias=False) on every token, then the logits of the last
  non-pad token. The head works row by row, so scoring only the pooled (last) token's
  hidden state gives the same numbers;
- token classification (GenericForTokenClassification): dropout, the identity at eval,
  then score = Linear(hidden, num_labels, bias=config.token_classification_bias, default
  True) on every token.

Tensor parallel: the score head is a replicated Linear. The final hidden states are the
same on every rank (the row-parallel layers all-reduce), so every rank scores alike.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from shared.model.layers import Linear
from shared.model.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

# transformers' default when a config names no labels (it omits id2label for 2 labels)
DEFAULT_NUM_LABELS = 2


def num_labels_of(hf_config) -> int:
    """The score head's outputs: len(id2label), else num_labels, else transformers' 2."""
    id2label = getattr(hf_config, "id2label", None)
    n = len(id2label) if id2label else getattr(hf_config, "num_labels", None)
    n = DEFAULT_NUM_LABELS if n is None else int(n)
    if n < 1:
        raise ValueError(f"{type(hf_config).__name__}: num_labels={n} must be >= 1")
    return n


class ClassificationHead:
    """Mixin for a LlamaForCausalLM subclass: the `score` head instead of the LM head.

    Put it first in the bases so that its hooks win; everything else (decoder, attention
    options, forward, forward_piecewise_eager, attention_layers, load_weights) is the
    causal LM class's."""

    pooling_head: ClassVar[str]  # the head kind, as policy.model_config names it

    def _score_bias(self, cfg) -> bool:
        raise NotImplementedError

    def _make_head(self, cfg) -> None:
        self.tie_word_embeddings = False  # there is no LM head to tie the embedding to
        self.num_labels = num_labels_of(cfg)
        self.score = Linear(cfg.hidden_size, self.num_labels, bias=self._score_bias(cfg))

    def _rename(self, name: str) -> str | None:
        # A converted checkpoint may keep the causal LM's head next to `score`: unused here.
        # (A checkpoint with no `score` still fails: load_hf_weights names it missing.)
        if name.startswith("lm_head."):
            return None
        return super()._rename(name)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise TypeError(
            f"{type(self).__name__} is a classification model: it has no LM head, so it "
            "computes no vocabulary logits and cannot generate; run it with a pooling task "
            "(its head is pooler_head: hidden [N, hidden] -> [N, num_labels])"
        )

    def pooler_head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [N, hidden] -> class logits [N, num_labels], in the
        model dtype (the pooler picks the N rows: last tokens, or every token)."""
        return self.score(hidden_states)


class SequenceClassificationHead(ClassificationHead):
    pooling_head = "sequence_classification"

    def _score_bias(self, cfg) -> bool:
        return False  # transformers: nn.Linear(hidden, num_labels, bias=False)


class TokenClassificationHead(ClassificationHead):
    pooling_head = "token_classification"

    def _score_bias(self, cfg) -> bool:
        return bool(getattr(cfg, "token_classification_bias", True))


class LlamaForSequenceClassification(SequenceClassificationHead, LlamaForCausalLM):
    pass


class Qwen2ForSequenceClassification(SequenceClassificationHead, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassificationHead, Qwen3ForCausalLM):
    pass


class LlamaForTokenClassification(TokenClassificationHead, LlamaForCausalLM):
    pass


class Qwen2ForTokenClassification(TokenClassificationHead, Qwen2ForCausalLM):
    pass


class Qwen3ForTokenClassification(TokenClassificationHead, Qwen3ForCausalLM):
    pass
