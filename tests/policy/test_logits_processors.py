"""Custom logits processors in the policy: which interface a class implements, and which
runner (or error) each interface x decision source gives. Expectations are written by
hand from the feature table's intent (V1 interface: V1 only; V2 interface: V2 only)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from policy import EngineArgs
from policy.logits_processors import interface_of, resolve_logits_processors
from policy.selection import RunnerSelectionError

V1_PROC = "runner_v1.example_logits_processors:NoRepeatNGram"
V2_PROC = "runner_v2.example_logits_processors:TargetTokenBoost"
VAR = "RUNNERLAB_USE_V2_MODEL_RUNNER"


class OnlyApply:
    def apply(self, logits):
        return logits


class Both:
    def update_state(self, batch_update): ...
    def apply(self, logits): ...
    def is_argmax_invariant(self): ...
    def add_request(self, slot, params): ...
    def remove_request(self, slot): ...


class DuckV2:  # no base class: the methods decide
    def add_request(self, slot, params): ...
    def remove_request(self, slot): ...
    def apply(self, logits, idx_mapping): ...


@pytest.fixture
def fake_module(monkeypatch):
    module = types.ModuleType("lp_fakes")
    for cls in (OnlyApply, Both, DuckV2):
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "lp_fakes", module)
    return module


def test_a_class_with_neither_interface_names_what_is_missing():
    with pytest.raises(ValueError) as err:
        interface_of(OnlyApply, "x:OnlyApply")
    msg = str(err.value)
    assert "implements neither" in msg
    assert "lacks update_state, is_argmax_invariant" in msg
    assert "lacks add_request, remove_request" in msg


def test_a_class_with_both_interfaces_is_refused():
    with pytest.raises(ValueError, match="implements both"):
        interface_of(Both, "x:Both")


def test_an_abstract_subclass_is_refused():
    from runner_v2.logits_processor import SlotLogitsProcessor

    class Half(SlotLogitsProcessor):
        def add_request(self, slot, params): ...

    with pytest.raises(ValueError, match="abstract: implement apply, remove_request"):
        interface_of(Half, "x:Half")


def test_interfaces_from_the_methods(fake_module):
    specs = resolve_logits_processors([V1_PROC, "runner_v2.example_logits_processors.NoRepeatNGram",
                                       "lp_fakes:DuckV2"])
    assert [s.interface for s in specs] == ["v1", "v2", "v2"]
    assert specs[1].qualname == "runner_v2.example_logits_processors:NoRepeatNGram"


@pytest.mark.parametrize("name, text", [
    ("nodots", "not a qualified class name"),
    ("no_such_pkg.mod:X", "cannot import module 'no_such_pkg.mod'"),
    ("runner_v1.example_logits_processors:Nope", "has no class 'Nope'"),
])
def test_bad_names(name, text):
    with pytest.raises(ValueError, match=text):
        EngineArgs(model="tiny-llama", device="cpu", logits_processors=[name]).create_engine_config()


def test_a_duplicate_is_refused():
    with pytest.raises(ValueError, match="twice"):
        resolve_logits_processors([V1_PROC, "runner_v1.example_logits_processors.NoRepeatNGram"])


def _decide(monkeypatch, env, **kw):
    if env is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, env)
    return EngineArgs(model="tiny-llama", device="cpu", **kw).create_engine_config()


def test_v1_interface_under_the_policy_falls_back_with_a_warning(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="runnerlab"):
        config = _decide(monkeypatch, None, logits_processors=[V1_PROC])
    decision = config.runner_decision
    assert (decision.runner, decision.source) == ("v1", "policy")
    (warning,) = decision.warnings
    assert V1_PROC in warning and "logits_processors=[]" in warning
    assert "custom logits processors (V1 interface)" in warning
    # the decision line itself names the processor too (its headline is the fallback)
    assert V1_PROC in decision.log_line()
    assert any(V1_PROC in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.mark.parametrize("env, kw", [("1", {}), (None, {"model_runner": "v2"})])
def test_v1_interface_with_v2_forced_is_an_error_naming_it(monkeypatch, env, kw):
    with pytest.raises(RunnerSelectionError) as err:
        _decide(monkeypatch, env, logits_processors=[V1_PROC], **kw)
    assert V1_PROC in str(err.value) and "does not support" in str(err.value)


@pytest.mark.parametrize("env, kw", [("0", {}), (None, {"model_runner": "v1"})])
def test_v1_interface_with_v1_forced_runs_v1(monkeypatch, env, kw):
    config = _decide(monkeypatch, env, logits_processors=[V1_PROC], **kw)
    assert config.runner_decision.runner == "v1" and config.runner_decision.warnings == []


def test_v2_interface_forces_v2(monkeypatch):
    decision = _decide(monkeypatch, None, logits_processors=[V2_PROC]).runner_decision
    assert (decision.runner, decision.source) == ("v2", "forced")
    assert V2_PROC in decision.log_line()


@pytest.mark.parametrize("env, kw", [("0", {}), (None, {"model_runner": "v1"})])
def test_v2_interface_with_v1_forced_is_an_error_naming_it(monkeypatch, env, kw):
    with pytest.raises(RunnerSelectionError) as err:
        _decide(monkeypatch, env, logits_processors=[V2_PROC], **kw)
    assert V2_PROC in str(err.value)


def test_one_of_each_interface_has_no_runner(monkeypatch):
    with pytest.raises(RunnerSelectionError) as err:
        _decide(monkeypatch, None, logits_processors=[V1_PROC, V2_PROC])
    assert "No model runner supports" in str(err.value)
    assert V1_PROC in str(err.value) and V2_PROC in str(err.value)


def test_with_speculative_decoding_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="logits_processors=.*speculative decoding"):
        _decide(monkeypatch, None, logits_processors=[V1_PROC],
                speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_nothing_installed_adds_a_processor(monkeypatch, fake_module):
    # an importable processor class that nobody listed changes nothing
    decision = _decide(monkeypatch, None).runner_decision
    assert decision.runner == "v2" and decision.requested_features == []
