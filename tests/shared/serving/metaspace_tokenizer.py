"""A SentencePiece-style (Metaspace) tokenizer for the output-text tests: the byte-level
BPE of the SmolLM2 tokenizer decodes a sequence the same alone or in context, this one
does not (it strips the leading space of a sequence's first piece)."""

from __future__ import annotations

from typing import Any


def metaspace_tokenizer(size: int) -> Any:
    """`size` word pieces: most start a word (U+2581), some are multibyte (é)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>"] + [("\u2581" if i % 3 else "") + ("é" if i % 7 == 0 else "") + f"w{i}"
                          for i in range(1, size)]
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
