"""The throughput floor (shared/harness/floor.py) against a step-by-step simulation written
here in plain Python, a case worked by hand, the issue's own estimate for qwen3-0.6b on
nano-vllm's workload, and parameter counts from the models' configs."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from shared.harness import floor as fl
from shared.harness import workloads as wl

SHAPE = fl.ModelShape(weight_bytes=1000, kv_bytes_per_token=7, matmul_params=50,
                      lm_head_params=30, num_layers=3, num_heads=2, head_dim=4)


def simulate(shape: fl.ModelShape, prompts: list[int], outputs: list[int], max_num_seqs: int,
             rates: fl.Rates) -> dict:
    """The floor's model played step by step: a waiting queue, `max_num_seqs` slots, each
    request prefilled on admission (its first token), then one token per decode step."""
    waiting = deque(range(len(prompts)))
    live: dict[int, int] = {}  # request -> output tokens so far
    steps = kv_tokens = 0
    flops = 0.0
    while waiting or live:
        while waiting and len(live) < max_num_seqs:
            i = waiting.popleft()
            for position in range(prompts[i]):  # token `position` attends to position + 1 tokens
                flops += 2 * shape.matmul_params
                flops += 4 * shape.num_layers * shape.num_heads * shape.head_dim * (position + 1)
            flops += 2 * shape.lm_head_params  # the LM head for its first token
            live[i] = 1
            if outputs[i] == 1:
                del live[i]
        if not live:
            continue
        steps += 1
        for i in list(live):
            kv_tokens += prompts[i] + live[i]  # attends over its prompt and outputs so far
            live[i] += 1
            if live[i] == outputs[i]:
                del live[i]
    read = steps * shape.weight_bytes + kv_tokens * shape.kv_bytes_per_token
    return {"steps": steps, "kv_bytes": kv_tokens * shape.kv_bytes_per_token, "flops": flops,
            "seconds": read / rates.read_bytes_per_s + flops / rates.matmul_flops_per_s}


def test_a_case_worked_by_hand() -> None:
    """Prompts 2 and 3 tokens, outputs 3 and 2. One slot: request 0 decodes at contexts 3
    and 4, then request 1 at context 4: 3 steps. Two slots: step 1 reads contexts 3 and 4,
    step 2 context 4: 2 steps. KV either way: (3 + 4 + 4) x 7 = 77 bytes. Prefill:
    2 x 50 x 5 GEMM + 4 x 3 x 2 x 4 x (3 + 6) attention + 2 x 30 x 2 LM head = 1484."""
    rates = fl.Rates(read_bytes_per_s=100.0, matmul_flops_per_s=742.0)
    one = fl.throughput_floor(SHAPE, [2, 3], [3, 2], 1, rates)
    two = fl.throughput_floor(SHAPE, [2, 3], [3, 2], 2, rates)
    assert (one.decode_steps, two.decode_steps) == (3, 2)
    assert one.kv_bytes_read == two.kv_bytes_read == 77
    assert one.weight_bytes_read == 3000 and two.weight_bytes_read == 2000
    assert one.prefill_flops == 1484
    assert one.decode_s == pytest.approx(30.77) and one.prefill_s == pytest.approx(2.0)
    assert one.seconds == pytest.approx(32.77)
    assert one.tokens_per_s == pytest.approx(5 / 32.77)
    assert two.seconds == pytest.approx(20.77 + 2.0)


def test_a_one_token_request_frees_its_slot_at_its_prefill() -> None:
    # request 0 ends at its prefill; request 1 takes the slot for the first decode step
    floor = fl.throughput_floor(SHAPE, [4, 4], [1, 3], 1, fl.Rates(1.0, 1.0))
    assert floor.decode_steps == 2 and floor.kv_bytes_read == (5 + 6) * 7


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_step_by_step_simulation(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 30)
    prompts = [rng.randint(1, 40) for _ in range(n)]
    outputs = [rng.randint(1, 25) for _ in range(n)]
    slots = rng.randint(1, n + 3)
    shape = fl.ModelShape(rng.randint(1, 10**6), rng.randint(1, 500), rng.randint(1, 10**5),
                          rng.randint(1, 10**4), rng.randint(1, 8), rng.randint(1, 8),
                          rng.choice([2, 4, 64]))
    rates = fl.Rates(rng.uniform(1e3, 1e6), rng.uniform(1e5, 1e9))
    floor = fl.throughput_floor(shape, prompts, outputs, slots, rates)
    ref = simulate(shape, prompts, outputs, slots, rates)
    assert floor.decode_steps == ref["steps"]
    assert floor.kv_bytes_read == ref["kv_bytes"]
    assert floor.prefill_flops == pytest.approx(ref["flops"], rel=1e-12)
    assert floor.seconds == pytest.approx(ref["seconds"], rel=1e-12)
    assert floor.output_tokens == sum(outputs)


def test_refuses_a_workload_without_one_output_per_prompt() -> None:
    with pytest.raises(ValueError, match="one output length"):
        fl.throughput_floor(SHAPE, [3, 4], [2], 4, fl.Rates(1.0, 1.0))
    with pytest.raises(ValueError, match="one output length"):
        fl.throughput_floor(SHAPE, [3], [0], 4, fl.Rates(1.0, 1.0))


def _meta_model(preset: str, dtype: torch.dtype):
    """A preset's model with its parameters on the meta device: shapes, no weights."""
    from policy.model_config import build_model_config
    from shared.model.loader import default_dtype
    from shared.model.registry import get_model_class, resolve_architecture

    mc = build_model_config(preset, str(dtype).removeprefix("torch."), "cpu", None)
    with default_dtype(dtype), torch.device("meta"):
        model = get_model_class(resolve_architecture(mc.hf_config))(mc.hf_config)
    return model, mc


def test_qwen3_0_6b_on_nano_vllms_workload_is_the_issues_estimate() -> None:
    """Issue 21: ~13.9 TB of KV and ~1.2 TB of weights over the decode steps, ~1.4e14
    prefill FLOPs; ~3.7 s at 4.3 TB/s, ~36,000 output tokens/s."""
    model, mc = _meta_model("qwen3-0.6b", torch.bfloat16)
    # tied embedding: the LM head reads all of it each step, and it is stored once
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = fl.model_shape(model, mc, weight_bytes)
    prompts, outputs = wl.nano_vllm_workload()
    floor = fl.throughput_floor(shape, [len(p) for p in prompts], outputs, 1024,
                                fl.Rates(4.3e12, 700e12))
    assert floor.decode_steps == max(outputs) - 1  # all 256 run at once
    assert floor.kv_bytes_read == pytest.approx(13.9e12, rel=0.01)
    assert floor.weight_bytes_read == pytest.approx(1.2e12, rel=0.03)
    assert floor.prefill_flops == pytest.approx(1.4e14, rel=0.03)
    assert floor.seconds == pytest.approx(3.7, rel=0.02)
    assert floor.tokens_per_s == pytest.approx(36_000, rel=0.02)


def _layer_matmuls(cfg) -> int:
    """Per layer: q, k, v, o projections and the three MLP matrices, from the config."""
    heads, kv, dim, hidden = (cfg.num_attention_heads, cfg.num_key_value_heads,
                              getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                              cfg.hidden_size)
    return hidden * dim * (2 * heads + 2 * kv)


def test_matmul_params_of_a_dense_model_from_its_config() -> None:
    model, mc = _meta_model("tiny-llama", torch.float32)
    cfg = mc.hf_config
    expected = cfg.num_hidden_layers * (_layer_matmuls(cfg)
                                        + 3 * cfg.hidden_size * cfg.intermediate_size)
    assert fl.matmul_params(model) == expected


def test_matmul_params_of_an_moe_model_count_the_routed_experts_a_token_runs() -> None:
    model, mc = _meta_model("tiny-mixtral", torch.float32)
    cfg = mc.hf_config
    experts = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.intermediate_size
    router = cfg.hidden_size * cfg.num_local_experts
    expected = cfg.num_hidden_layers * (_layer_matmuls(cfg) + experts + router)
    assert fl.matmul_params(model) == pytest.approx(expected)
