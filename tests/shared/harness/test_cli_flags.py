"""Every `runnerlab` flag is honoured or refused: a refusal is one line on stderr naming
the flag, exit status 2, no traceback (generate, explain, diff; ab in test_ab_cli.py);
and the KV-cache error gives only advice that works on the device."""

from __future__ import annotations

import json
import types

import pytest
import torch

from policy import EngineArgs
from policy.cli_args import one_line
from shared.harness.cli import main as cli_main
from shared.serving.engine import EngineInputError, LLMEngine

GENERATE = ["generate", "--model", "tiny-llama", "--device", "cpu", "--max-model-len", "32"]


def _one_line_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"runnerlab {prog}: error: "), err
    return err.strip().removeprefix(f"runnerlab {prog}: error: ")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--prompt-ids", "1,x"], "--prompt-ids: 'x' is not an integer"),
    (["--prompt-ids", "1,-2"], "--prompt-ids: token id -2 is not valid"),
    (["--prompt-ids", ","], "--prompt-ids: give at least one token id"),
    (["--prompt-ids", "1", "--max-tokens", "two"], "--max-tokens: invalid int value: 'two'"),
    (["--prompt-ids", "1,2", "--chat"], "--chat applies the chat template to --prompt text"),
    (["--prompt-ids", "1,2", "--logprobs", "2"], "--logprobs: the log-probabilities are printed "
                                                 "only with --json"),
    (["--prompt-ids", "1", "--gpu-memory-utilization", "0.5"],
     "--gpu-memory-utilization has no effect on the CPU"),
    (["--prompt-ids", "1", "--speculative-config", '{"method": 5}'],
     "speculative_config.method: Input should be 'ngram' or 'draft_model' (got 5)"),
])
def test_generate_refusals(argv, expected, capsys) -> None:
    assert cli_main(GENERATE + argv) == 2
    assert _one_line_error(capsys, "generate").startswith(expected)


def test_generate_json_carries_the_logprobs_asked_for(capsys) -> None:
    rc = cli_main(GENERATE + ["--prompt-ids", "5,6", "--max-tokens", "2", "--logprobs", "3",
                              "--json", "--model-runner", "v1"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(record["logprobs"]) == 2
    for position, token in zip(record["logprobs"], record["token_ids"]):
        assert str(token) in position and 3 <= len(position) <= 4  # sampled + top 3


@pytest.mark.parametrize(("argv", "expected"), [
    (["--max-model-len", "x"], "--max-model-len: invalid int value: 'x'"),
    (["--block-size", "12"], "block_size=12 is not valid"),
    (["--dtype", "fp8"], "--dtype: invalid choice: 'fp8'"),
])
def test_explain_refusals(argv, expected, capsys) -> None:
    try:
        rc = cli_main(["explain", "--model", "tiny-llama", *argv])
    except SystemExit as exc:  # argparse's own errors exit from explain_main
        rc = exc.code
    assert rc == 2
    assert _one_line_error(capsys, "explain").startswith(expected)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--seeds", "1,x"], "--seeds: seeds must be integers >= 0"),
    (["--logprob-tol", "-1"], "--logprob-tol: -1.0 is not valid"),
    (["--logprob-tol", "tight"], "--logprob-tol: 'tight' is not a number"),
    (["--quick", "--scenarios", "greedy_logprobs"], "--quick picks the scenarios"),
    (["--engines", "v1,hf", "--logprob-tol", "1e-3"], "--logprob-tol is the tolerance between"),
    (["--engines", "hf,solo"], "--engines needs v1, v2, v1-async or v2-async"),
])
def test_diff_refusals(argv, expected, capsys) -> None:
    assert cli_main(["diff", *argv]) == 2
    assert _one_line_error(capsys, "diff").startswith(expected)


def _kv_error(device: str) -> str:
    """The KV check on a stand-in engine: the message depends only on these fields."""
    engine = types.SimpleNamespace(
        config=types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=16)),
        max_model_len=64, device=torch.device(device))
    with pytest.raises(EngineInputError) as exc:
        LLMEngine._check_kv_fits_one_request(engine, 2)
    return str(exc.value)


def test_kv_too_small_advice_fits_the_device() -> None:
    cpu = _kv_error("cpu")
    assert "fewer than the 4 blocks" in cpu
    assert "gpu_memory_utilization" not in cpu  # the CPU ignores it
    assert "raise num_gpu_blocks_override or lower max_model_len" in cpu
    cuda = _kv_error("cuda")
    assert "raise gpu_memory_utilization or num_gpu_blocks_override or lower max_model_len" in cuda


def test_kv_too_small_on_cpu_through_the_cli(capsys) -> None:
    rc = cli_main(GENERATE + ["--prompt-ids", "1", "--num-gpu-blocks-override", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]  # after the engine's INFO lines
    assert line.startswith("runnerlab generate: error: the KV cache holds 1 blocks")
    assert "gpu_memory_utilization" not in line


def test_validation_errors_become_one_line() -> None:
    with pytest.raises(ValueError) as exc:
        EngineArgs(model="tiny-llama", speculative_config={"method": 5, "num_speculative_tokens": 2})
    assert "\n" in str(exc.value)  # pydantic's own text spans lines
    assert one_line(exc.value) == ("speculative_config.method: Input should be 'ngram' or "
                                   "'draft_model' (got 5)")
    assert one_line("a\n  b") == "a b"
