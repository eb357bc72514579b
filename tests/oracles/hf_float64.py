"""The float64 Hugging Face oracle: transformers computes RMSNorm, RoPE frequencies and
MoE routing in float32 even in a float64 model. These patches keep its semantics and only
make those spots float64, so a comparison against it can be exact to ~1e-12
(tests/shared/model/test_model_hf.py; its test_unpatched_transformers_float64_is_close_too
guards the patches against changing semantics)."""

from __future__ import annotations

import math
import types

import torch


def _exact_inv_freq(module) -> torch.Tensor:
    rp = module.config.rope_parameters
    dim = module.inv_freq.shape[0] * 2
    freqs = [1.0 / rp["rope_theta"] ** (i / dim) for i in range(0, dim, 2)]
    if rp["rope_type"] == "llama3":
        f, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        orig = rp["original_max_position_embeddings"]
        out = []
        for fr in freqs:
            wavelen = 2 * math.pi / fr
            if wavelen < orig / hi:
                out.append(fr)
            elif wavelen > orig / lo:
                out.append(fr / f)
            else:
                s = (orig / wavelen - lo) / (hi - lo)
                out.append((1 - s) * fr / f + s * fr)
        freqs = out
    exact = torch.tensor(freqs, dtype=torch.float64)
    # transformers stays the authority on the formula: its float32 table must agree
    torch.testing.assert_close(exact, module.inv_freq.double(), rtol=2e-6, atol=0)
    return exact


def _rms_forward(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rope_forward(self, x, position_ids):
    freqs = position_ids[..., None].double() * self.exact_inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _router_forward(self, hidden_states):
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


def make_float64_exact(model) -> None:
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_forward, module)
        elif kind.endswith("RotaryEmbedding"):
            module.exact_inv_freq = _exact_inv_freq(module)
            module.forward = types.MethodType(_rope_forward, module)
        elif kind.endswith("TopKRouter"):
            module.forward = types.MethodType(_router_forward, module)


def hf_oracle(model, dtype: torch.dtype):
    model = model.to(dtype)
    if dtype == torch.float64:
        make_float64_exact(model)
    return model


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0]
