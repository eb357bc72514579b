"""The model's tokenizer, where one exists: SmolLM2's from its GGUF file, a local HF
directory's own tokenizer files, none for the random-weight tiny presets."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(model_config: Any) -> Any | None:
    if model_config.gguf_path:
        from shared.model.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(model_config.gguf_path)
    model_dir = model_config.model_dir
    if model_dir and not model_config.preset and _has_tokenizer_files(model_dir):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    return None


def _has_tokenizer_files(model_dir: str) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    return any(os.path.exists(os.path.join(model_dir, n)) for n in names)
