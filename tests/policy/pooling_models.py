"""Small Llama configs with a classifier head, for the pooling tests: a config.json written
by transformers' LlamaConfig into a temporary directory (no weights: load_format="dummy"),
and a fixture that lets the policy treat their architectures as implemented (another
session adds them to the model registry; these tests must not depend on it)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import pytest

from policy import model_config

SEQ_CLS = "LlamaForSequenceClassification"
TOKEN_CLS = "LlamaForTokenClassification"
# distinct label counts, so a test can tell which config a num_labels came from
NUM_LABELS = {SEQ_CLS: 3, TOKEN_CLS: 5}


@functools.cache
def classifier_dir(architecture: str) -> str:
    """A directory holding a config.json for a tiny Llama with `architecture`'s head."""
    from transformers import LlamaConfig

    directory = Path(tempfile.mkdtemp(prefix=f"runnerlab-{architecture}-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    LlamaConfig(architectures=[architecture], num_labels=NUM_LABELS[architecture],
                hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                max_position_embeddings=512).to_json_file(str(directory / "config.json"))
    return str(directory)


def register_classifiers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_config, "RUNNERLAB_ARCHITECTURES",
                        model_config.RUNNERLAB_ARCHITECTURES | {SEQ_CLS, TOKEN_CLS})
