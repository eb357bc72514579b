"""`python -m policy explain`, as a user runs it (subprocesses, started together to save
wall time: each pays ~5 s of CPU importing transformers and torch) and in-process through
explain_main for the remaining paths."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy import EngineArgs, add_engine_args, engine_args_from_namespace
from policy.__main__ import main as policy_main
from policy.explain import explain_main

ROOT = Path(__file__).resolve().parents[2]
VAR = "RUNNERLAB_USE_V2_MODEL_RUNNER"

FOREIGN = {
    "mamba": {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "vocab_size": 128},
    "jamba": {"model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_experts": 4, "vocab_size": 128},
    "unknown": {"model_type": "made_up_lm", "architectures": ["MadeUpForCausalLM"],
                "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1},
}

# name -> (argv after "explain", extra env)
RUNS = {
    "llama": (["--model", "tiny-llama"], {}),
    "mixtral": (["--model", "tiny-mixtral", "--json"], {}),
    "env0": (["--model", "tiny-llama", "--json"], {VAR: "0"}),
    "maybe": (["--model", "tiny-llama"], {VAR: "maybe"}),
    "mamba": (["--json", "--model", "{mamba}"], {}),
    # block verification with V1 forced by the env var: explained, and an error (exit 1)
    "spec-block-env0": (["--json", "--model", "tiny-llama", "--speculative-config",
                         '{{"method":"draft_model","model":"tiny-llama-draft",'
                         '"num_speculative_tokens":2,"rejection_sample_method":"block"}}'],
                        {VAR: "0"}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every subprocess at once, then collect (returncode, stdout, stderr)."""
    base = tmp_path_factory.mktemp("foreign")
    dirs = {}
    for name, raw in FOREIGN.items():
        (base / name).mkdir()
        (base / name / "config.json").write_text(json.dumps(raw))
        dirs[name] = str(base / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNNERLAB_")}
    procs = {}
    for name, (argv, extra) in RUNS.items():
        argv = [a.format(**dirs) for a in argv]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "policy", "explain", *argv], cwd=ROOT, env=env | extra,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return {name: (p.wait(timeout=300), p.stdout.read(), p.stderr.read())
            for name, p in procs.items()}


def test_tiny_llama_text(runs):
    rc, out, err = runs["llama"]
    assert rc == 0, err
    assert out.startswith("Model runner: V2 (runner_v2.model_runner:GPUModelRunner)")
    assert "source: policy" in out and "dense architecture LlamaForCausalLM is eligible" in out
    assert "implemented by runnerlab: yes" in out and "Traceback" not in err


DECISION_FIELDS = {"runner", "source", "reasons", "unsupported_v2", "runner_class"}


def test_tiny_mixtral_json(runs):
    rc, out, err = runs["mixtral"]
    assert rc == 0, err
    report = json.loads(out)
    assert DECISION_FIELDS <= report.keys()
    assert (report["runner"], report["source"]) == ("v1", "policy")
    assert report["runner_class"] == "runner_v1.model_runner:GPUModelRunner"
    assert "not on DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES" in report["reasons"][0]
    assert "Qwen2MoeForCausalLM" in report["reasons"][0]
    assert report["model"]["is_moe"] and report["model"]["num_experts"] == 4
    assert report["unsupported_v2"] == [] and report["run_blockers"] == []


def test_env_zero_turns_llama_to_v1(runs):
    rc, out, err = runs["env0"]
    assert rc == 0, err
    report = json.loads(out)
    assert (report["runner"], report["source"]) == ("v1", "env")
    assert report["reasons"][0] == f"{VAR}=0" and report["env"][VAR] == "0"


def test_bad_env_value_exits_nonzero(runs):
    rc, out, err = runs["maybe"]
    assert rc == 2 and out == ""
    assert f"{VAR}='maybe'" in err and "'1', 'true', '0', 'false'" in err
    assert "Traceback" not in err


def test_mamba_is_attention_free_v1(runs):
    rc, out, err = runs["mamba"]
    assert rc == 0, err
    report = json.loads(out)
    assert report["runner"] == "v1" and "attention-free" in report["reasons"][0]
    assert report["model"]["is_attention_free"] and not report["model"]["supported_by_runnerlab"]
    assert "runnerlab implements neither runner for MambaForCausalLM" in report["reasons"]
    assert any("neither runner" in b for b in report["run_blockers"])


def test_block_verification_on_v1_exits_1_naming_the_field(runs):
    rc, out, err = runs["spec-block-env0"]
    assert rc == 1, err
    report = json.loads(out)
    assert (report["runner"], report["source"]) == ("v1", "env")
    assert report["error"].startswith(
        "Model runner V1 (chosen by RUNNERLAB_USE_V2_MODEL_RUNNER=0) does not support: "
        "rejection_sample_method='block'.")
    assert "model_runner='v2'" in report["error"]
    assert report["speculative_config"]["draft_model"]["model"] == "tiny-llama-draft"


def _explain_in_process(capsys, argv):
    assert explain_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_jamba_is_hybrid(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(FOREIGN["jamba"]))
    report = _explain_in_process(capsys, ["--json", "--model", str(tmp_path)])
    assert report["runner"] == "v1" and "hybrid" in report["reasons"][0]
    assert report["model"]["is_hybrid"] and report["model"]["is_moe"]


def test_unknown_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(FOREIGN["unknown"]))
    report = _explain_in_process(capsys, ["--json", "--model", str(tmp_path / "config.json")])
    assert report["model"]["parsed_by"] == "generic"
    assert report["model"]["architecture"] == "MadeUpForCausalLM"
    assert report["runner"] == "v2" and "dense architecture MadeUpForCausalLM" in report["reasons"][0]
    assert "runnerlab implements neither runner for MadeUpForCausalLM" in report["reasons"]


# ----------------------------------------------------------------------------- in-process

def test_forced_runner_error_exits_1_with_the_explanation(monkeypatch, capsys):
    monkeypatch.setenv(VAR, "1")
    rc = explain_main(["--model", "tiny-llama", "--logits-processors",
                       "runner_v1.example_logits_processors:NoRepeatNGram"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "error: Model runner V2 (chosen by RUNNERLAB_USE_V2_MODEL_RUNNER=1)" in out
    assert "custom logits processors (V1 interface)" in out and "logits_processors=[]" in out
    assert "runner_v1.example_logits_processors:NoRepeatNGram" in out


def test_bad_flag_value_exits_2(capsys):
    assert explain_main(["--model", "tiny-llama", "--block-size", "12"]) == 2
    err = capsys.readouterr().err
    assert "block_size=12" in err and "power of two" in err


def test_unknown_choice_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        explain_main(["--model", "tiny-llama", "--dtype", "fp8"])
    assert exc.value.code == 2 and "--dtype" in capsys.readouterr().err


def test_shape_only_preset_explains_and_lists_the_blocker(capsys):
    assert explain_main(["--model", "llama-3-8b", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runner"] == "v2" and report["model"]["is_shape_only"]
    assert any('load_format="dummy"' in b for b in report["run_blockers"])
    assert explain_main(["--model", "llama-3-8b", "--load-format", "dummy", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_blockers"] == []


def test_cuda_explained_without_a_gpu(no_cuda, capsys):
    assert explain_main(["--model", "tiny-llama", "--device", "cuda", "--json",
                         "--cudagraph-mode", "FULL_AND_PIECEWISE"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runner"] == "v2" and report["unsupported_v2"] == []
    assert report["config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert report["config"]["dtype"] == "bfloat16" and report["config"]["device"] == "cuda"
    assert any("no CUDA GPU" in b for b in report["run_blockers"])


def test_features_subcommand(capsys):
    assert policy_main(["features"]) == 0
    out = capsys.readouterr().out
    assert "rejection_sample_method='block'" in out and "unsupported-yet" in out
    assert policy_main(["bogus"]) == 2


def test_engine_flags_round_trip():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for name in EngineArgs.model_fields:
        assert "--" + name.replace("_", "-") in flags
    ns = parser.parse_args([
        "--model", "tiny-qwen3", "--max-model-len", "256", "--no-enable-prefix-caching",
        "--enforce-eager", "--cudagraph-capture-sizes", "1", "2", "--model-runner", "v1",
        "--speculative-config", '{"method": "draft_model", "model": "tiny-llama-draft", '
                                '"num_speculative_tokens": 2, "rejection_sample_method": "block"}',
        "--gpu-memory-utilization", "0.5", "--pooling-task", "embed",
    ])
    args = engine_args_from_namespace(ns, seed=7)
    assert args.model == "tiny-qwen3" and args.max_model_len == 256
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert args.cudagraph_capture_sizes == [1, 2] and args.model_runner == "v1"
    assert args.speculative_config.rejection_sample_method == "block"
    assert args.speculative_config.model == "tiny-llama-draft"
    assert args.speculative_config.num_speculative_tokens == 2
    assert args.gpu_memory_utilization == 0.5 and args.pooling_task == "embed" and args.seed == 7
    # flags not given keep EngineArgs' own defaults
    assert args.block_size == 16 and args.dtype == "auto" and args.enable_chunked_prefill is True
