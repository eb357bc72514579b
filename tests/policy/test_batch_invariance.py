"""policy/batch_invariance.py and its switches: the argument, the variable and the kernel
options each turn the mode on; a backend that cannot honour it is refused by name; what
stays variant is listed (warned at engine start, shown by explain), never ignored."""

import json
import logging

import pytest

from policy import EngineArgs
from policy.envs import RUNNERLAB_BATCH_INVARIANT, EnvVarError
from policy.explain import explain_main


def _config(**kw):
    return EngineArgs(model="tiny-llama", **kw).create_engine_config()


@pytest.mark.parametrize("how", ["argument", "variable", "kernel_options"])
def test_each_switch_turns_the_mode_on(monkeypatch, how):
    kw = {}
    if how == "argument":
        kw["batch_invariant"] = True
    elif how == "variable":
        monkeypatch.setenv(RUNNERLAB_BATCH_INVARIANT, "1")
    else:
        kw["kernel_options"] = {"batch_invariant": True}
    config = _config(**kw)
    assert config.kernel_options.batch_invariant and config.batch_invariance.enabled
    assert "batch-invariant mode" in config.requested_features()


def test_off_by_default_and_the_variable_never_turns_it_off(monkeypatch):
    assert not _config().kernel_options.batch_invariant
    monkeypatch.setenv(RUNNERLAB_BATCH_INVARIANT, "0")
    assert not _config().batch_invariance.enabled
    assert _config(batch_invariant=True).batch_invariance.enabled


def test_a_bad_variable_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(RUNNERLAB_BATCH_INVARIANT, "yes")
    with pytest.raises(EnvVarError, match=RUNNERLAB_BATCH_INVARIANT):
        _config()


def test_flash_attn_is_refused_by_name(fake_cuda):
    with pytest.raises(ValueError) as err:
        _config(device="cuda", attention_backend="FLASH_ATTN", batch_invariant=True)
    message = str(err.value)
    assert "batch_invariant=True" in message and "attention_backend='FLASH_ATTN'" in message
    assert "attention_backend='TRITON'" in message  # the fix


def test_what_stays_variant_is_listed(fake_cuda):
    triton = _config(device="cuda", attention_backend="TRITON", batch_invariant=True)
    assert triton.batch_invariance.not_invariant == ()
    torch_backend = _config(attention_backend="TORCH", batch_invariant=True)
    assert any("TORCH backend" in v for v in torch_backend.batch_invariance.not_invariant)
    tp = _config(device="cuda", attention_backend="TRITON", batch_invariant=True,
                 tensor_parallel_size=2)
    assert any("tensor_parallel_size=2" in v for v in tp.batch_invariance.not_invariant)


def test_engine_start_logs_the_mode_and_warns_what_is_variant(caplog):
    with caplog.at_level(logging.INFO, logger="runnerlab"):
        _config(attention_backend="TORCH", batch_invariant=True)
    decision = [r for r in caplog.records if r.getMessage().startswith("Model runner:")]
    assert len(decision) == 1 and decision[0].getMessage().endswith("batch-invariant mode on")
    assert any(r.levelno == logging.WARNING and "not invariant" in r.getMessage()
               for r in caplog.records)


def test_explain_shows_the_mode(capsys):
    assert explain_main(["--model", "tiny-llama", "--batch-invariant"]) == 0
    text = capsys.readouterr().out
    assert "Batch-invariant mode: on" in text and "not invariant: attention on the TORCH" in text
    assert explain_main(["--model", "tiny-llama", "--batch-invariant", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["batch_invariant"] is True
    assert report["batch_invariance"]["enabled"] is True
    assert explain_main(["--model", "tiny-llama", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_invariance"]["enabled"] is False
