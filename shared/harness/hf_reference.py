"""The Hugging Face side of `runnerlab diff`: greedy generation with transformers on the
same weights the engines load.

- A random-weight preset (tiny-*) has no checkpoint, so one is materialised: the HF
  model is built from the preset's config.json with a seeded init and saved as
  safetensors into a directory; every engine of the comparison then runs with
  `model=<that directory>`, so runnerlab and transformers read identical tensors.
- smollm2-135m: transformers loads the GGUF itself (its own dequantisation and q/k
  un-permutation), runnerlab loads it through shared.model.gguf.

Greedy here is `generate(do_sample=False)` with EOS disabled by clearing
generation_config.eos_token_id (min_new_tokens would mask EOS and change the argmax).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

# Before any transformers model code runs: building a model imports triton, and on a
# machine without a GPU the interpreter must be chosen before triton's own @jit helpers
# are decorated, or every V2 kernel launched later in this process fails.
import shared.runtime.triton_utils  # noqa: F401
from shared.contract.sampling_params import SamplingParams
from shared.model.loader import default_dtype

logger = logging.getLogger("runnerlab")

# Architectures transformers implements natively that runnerlab implements too.
HF_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM",
     "Qwen2MoeForCausalLM"}
)
# Init scale of materialised checkpoints. Larger than the 0.02 of HF's own init: logits
# of a 0.02-init model are nearly flat, and greedy comparisons need clear argmax gaps
# (transformers computes RMSNorm and RoPE in float32 even in a float64 model).
CHECKPOINT_STD = 0.1

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16}


def hf_comparable(params: SamplingParams) -> bool:
    """Whether a request's tokens are plain greedy, i.e. what HF's greedy search produces:
    temperature 0, no penalties, and no min_tokens (it masks EOS / stop ids, which can
    change the argmax). Stops and length limits only cut the sequence: its prefix is
    still greedy."""
    return params.temperature == 0.0 and not params.uses_penalties and params.min_tokens == 0


def is_random_preset(model: str) -> bool:
    from policy.presets import is_preset, preset_kind

    return is_preset(model) and preset_kind(model) == "random"


def hf_supports(model: str) -> bool:
    """transformers can serve as the oracle for this model (by preset or directory)."""
    from policy.model_config import read_config_json, resolve_model_source

    try:
        preset, config_path, _ = resolve_model_source(model)
        raw = read_config_json(config_path, model)
    except ValueError:
        return False
    if preset is not None and preset != "smollm2-135m" and not is_random_preset(preset):
        return False  # shape-only presets: no weights to compare on
    archs = raw.get("architectures") or []
    return bool(archs) and archs[0] in HF_ARCHITECTURES


@torch.no_grad()
def materialize_checkpoint(preset: str, seed: int, directory: str) -> str:
    """Save a seeded random HF checkpoint of a random-weight preset into `directory`
    (config.json + model.safetensors, float32) and return the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from policy.presets import preset_config_path

    hf_logging.disable_progress_bar()
    config = AutoConfig.from_pretrained(str(preset_config_path(preset).parent))
    with default_dtype(torch.float32):
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    # named_parameters() visits tied weights once: the saved file holds one tensor.
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            param.copy_(1.0 + 0.1 * noise)  # around 1, so a dropped norm weight shows
        else:
            param.copy_(CHECKPOINT_STD * noise)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    return directory


class HFGreedy:
    """One transformers model, ready for per-request greedy generation."""

    def __init__(self, model: str, dtype: str = "float64", device: str = "cpu"):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: accepted {sorted(_DTYPES)}")
        self.device = torch.device(device)
        self.model = _load(model, _DTYPES[dtype], self.device)
        gc = self.model.generation_config
        gc.eos_token_id = None  # the engines ignore EOS in compared requests
        gc.pad_token_id = 0  # silences the "no pad token" warning; batch size is 1
        for name in ("temperature", "top_p", "top_k"):  # unused by greedy; avoid warnings
            setattr(gc, name, None)

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        """-> (greedy tokens, raw logprob of each chosen token)."""
        if max_new_tokens < 1:
            return [], []
        input_ids = torch.tensor([prompt], device=self.device)
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
            max_new_tokens=max_new_tokens, min_new_tokens=None, return_dict_in_generate=True,
            output_logits=True,
        )
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [
            float(torch.log_softmax(step_logits[0].double(), dim=-1)[tok])
            for step_logits, tok in zip(out.logits, tokens)
        ]
        return tokens, logprobs


def _load(model: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if model == "smollm2-135m":
        from shared.model.gguf import find_smollm2_gguf

        path = find_smollm2_gguf()
        hf = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
        )
    elif os.path.isdir(model):
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    else:
        raise ValueError(
            f"model={model!r}: transformers needs a checkpoint directory or smollm2-135m; "
            "materialise a random preset with materialize_checkpoint() first"
        )
    if hasattr(hf, "set_experts_implementation"):
        with contextlib.suppress(Exception):  # dense models have no experts to switch
            hf.set_experts_implementation("eager")  # float64 fails on grouped_mm
    logger.info("Hugging Face reference: %s (%s, %s)", type(hf).__name__, dtype, device)
    return hf.to(device).eval()
