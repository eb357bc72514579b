"""Small Llama models with a classifier head, for the pooling tests: a config.json written
by transformers' LlamaConfig into a temporary directory (no weights: load_format="dummy");
and seeded checkpoints with weights, for runs compared with transformers."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

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


def save_classifier(path: str, architecture: str) -> str:
    """A seeded tiny-llama with `architecture`'s head and its weights saved into `path`
    (float32; norms near 1 and small weights, so its logits are not saturated)."""
    import torch
    from transformers import AutoConfig, LlamaForSequenceClassification, LlamaForTokenClassification

    from policy.presets import preset_config_path

    config = AutoConfig.from_pretrained(str(preset_config_path("tiny-llama").parent))
    config.num_labels, config.pad_token_id = NUM_LABELS[architecture], 0
    cls = {SEQ_CLS: LlamaForSequenceClassification, TOKEN_CLS: LlamaForTokenClassification}[
        architecture]
    config.architectures = [cls.__name__]
    torch.manual_seed(1)
    model = cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@functools.cache
def classifier_checkpoint(architecture: str) -> str:
    """save_classifier into a temporary directory, once per process."""
    directory = tempfile.mkdtemp(prefix=f"runnerlab-{architecture}-weights-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return save_classifier(directory, architecture)
