"""Speculative decoding's configuration and its policy gates: every bad SpeculativeConfig is
refused naming the field, the bad value and the accepted values; the draft model is checked
against the target at create_engine_config() time; each method x rejection rule x runner
source gives the runner or the error that DESIGN.md section 10 asks for (written out by
hand below, not read from policy.features); explain reports all of it."""

import json
import logging
import math

import pytest
from pydantic import ValidationError

from policy import EngineArgs, RunnerSelectionError, SpeculativeConfig, SpeculativeSettings
from policy import presets as presets_module
from policy.cli_args import one_line
from policy.explain import explain_main

VAR = "RUNNERLAB_USE_V2_MODEL_RUNNER"
DRAFT = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": 2}
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
SYNTHETIC = {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.5]}

# ------------------------------------------------------------ SpeculativeConfig on its own

# (settings, texts the message must contain)
BAD = [
    ({"method": "eagle", "num_speculative_tokens": 2},
     ["method", "'eagle'", "'ngram'", "'draft_model'"]),
    ({"method": "ngram"}, ["num_speculative_tokens=None", "required", "an integer in 1..16"]),
    (NGRAM | {"num_speculative_tokens": 0}, ["num_speculative_tokens=0", "1..16"]),
    (DRAFT | {"num_speculative_tokens": 17}, ["num_speculative_tokens=17", "1..16"]),
    (NGRAM | {"num_speculative_tokens": "two"}, ["num_speculative_tokens", "'two'"]),
    (NGRAM | {"prompt_lookup_min": 0}, ["prompt_lookup_min=0", "an integer >= 1"]),
    (NGRAM | {"prompt_lookup_min": 1, "prompt_lookup_max": 0},
     ["prompt_lookup_max=0", "an integer >= 1"]),
    (NGRAM | {"prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ["prompt_lookup_min=4", "an integer in 1..prompt_lookup_max=2"]),
    (NGRAM | {"model": "tiny-llama-draft"},
     ["model='tiny-llama-draft'", "None with method='ngram'", "method='draft_model'"]),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     ["model=None", "tiny-llama-draft", "llama-3.2-1b", "config.json"]),
    (DRAFT | {"prompt_lookup_min": 2}, ["prompt_lookup_min=2", "None with method='draft_model'"]),
    (DRAFT | {"prompt_lookup_max": 3}, ["prompt_lookup_max=3", "None with method='draft_model'"]),
    (DRAFT | {"rejection_sample_method": "strict"},
     ["rejection_sample_method", "'strict'", "'standard'", "'synthetic'", "'block'"]),
    (DRAFT | {"rejection_sample_method": "synthetic"},
     ["synthetic_acceptance_rates=None", "required", "num_speculative_tokens=2", "[0, 1]"]),
    (DRAFT | SYNTHETIC | {"synthetic_acceptance_rates": [0.5]},
     ["synthetic_acceptance_rates=[0.5]", "num_speculative_tokens=2", "1 rates given"]),
    (NGRAM | SYNTHETIC | {"synthetic_acceptance_rates": [0.5, 1.5]},
     ["synthetic_acceptance_rates=[0.5, 1.5]", "outside [0, 1]: [1.5]"]),
    (DRAFT | SYNTHETIC | {"synthetic_acceptance_rates": [-0.1, 0.5]}, ["outside [0, 1]: [-0.1]"]),
    (DRAFT | SYNTHETIC | {"synthetic_acceptance_rates": [math.nan, 0.5]}, ["outside [0, 1]: [nan]"]),
    (DRAFT | {"synthetic_acceptance_rates": [0.5, 0.5]},
     ["synthetic_acceptance_rates=[0.5, 0.5]", "None with rejection_sample_method='standard'",
      "ignored"]),
    (NGRAM | {"rejection_sample_method": "block", "synthetic_acceptance_rates": [0.5, 0.5]},
     ["None with rejection_sample_method='block'"]),
    (DRAFT | {"draft_tensor_parallel_size": 1}, ["draft_tensor_parallel_size", "Extra inputs"]),
]


@pytest.mark.parametrize("settings, texts", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_config_names_the_field(settings, texts):
    with pytest.raises(ValidationError) as err:
        SpeculativeConfig(**settings)
    for text in texts:
        assert text in str(err.value), str(err.value)
    # through EngineArgs (and so through --speculative-config): the same message, placed
    with pytest.raises(ValidationError) as err:
        EngineArgs(model="tiny-llama", speculative_config=settings)
    line = one_line(err.value)
    assert line.startswith("speculative_config"), line
    for text in texts:
        assert text.strip("'") in line, line


@pytest.mark.parametrize("given, expected", [
    ({}, (5, 5)),                                    # vLLM's defaults
    ({"prompt_lookup_max": 3}, (3, 3)),              # one given: the other copies it
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
    ({"prompt_lookup_min": None, "prompt_lookup_max": 7}, (7, 7)),
])
def test_ngram_prompt_lookup_defaults(given, expected):
    spec = SpeculativeConfig(**NGRAM, **given)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == expected


def test_good_configs_and_their_defaults():
    draft = SpeculativeConfig(**DRAFT)
    assert (draft.rejection_sample_method, draft.prompt_lookup_min, draft.prompt_lookup_max,
            draft.synthetic_acceptance_rates) == ("standard", None, None, None)
    for k in (1, 16):
        assert SpeculativeConfig(**NGRAM | {"num_speculative_tokens": k}).num_speculative_tokens == k
    edges = SpeculativeConfig(**DRAFT | SYNTHETIC | {"synthetic_acceptance_rates": [0, 1]})
    assert edges.synthetic_acceptance_rates == [0.0, 1.0]
    with pytest.raises(ValidationError):  # frozen
        draft.num_speculative_tokens = 3


# ------------------------------------------------------------ the draft against the target

def _create(**kwargs):
    kwargs.setdefault("model", "tiny-llama")
    kwargs.setdefault("device", "cpu")
    return EngineArgs(**kwargs).create_engine_config()


def _config_dir(tmp_path, name, raw, safetensors=False):
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    if safetensors:
        (path / "model.safetensors").write_bytes(b"")
    return str(path)


def _preset_raw(name):
    return json.loads((presets_module.PRESETS_DIR / name / "config.json").read_text())


FOREIGN_DRAFTS = {  # vocab 512 like tiny-llama, so that only the architecture is wrong
    "jamba": ({"model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 64,
               "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_experts": 4, "vocab_size": 512}, "JambaForCausalLM is MoE"),
    "zamba": ({"model_type": "zamba", "architectures": ["ZambaForCausalLM"], "vocab_size": 512},
              "ZambaForCausalLM is hybrid attention/mamba"),
    "mamba": ({"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 64,
               "num_hidden_layers": 2, "vocab_size": 512}, "MambaForCausalLM is attention-free"),
    "foo": ({"model_type": "foo_lm", "architectures": ["FooForCausalLM"], "hidden_size": 32,
             "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 512},
            "runnerlab implements neither runner for FooForCausalLM"),
}


@pytest.mark.parametrize("draft, texts", [
    ("llama-3.2-1b", ["speculative_config.model='llama-3.2-1b'", "vocab_size=512",
                      "vocab_size is 128256"]),
    ("tiny-mixtral", ["speculative_config.model='tiny-mixtral'", "MixtralForCausalLM is MoE",
                      "dense", "tiny-llama-draft"]),
    ("tiny-qwen2-moe", ["Qwen2MoeForCausalLM is MoE"]),
    ("no-such-draft", ["speculative_config.model", "'no-such-draft'", "tiny-llama-draft"]),
])
def test_unusable_draft_preset_is_refused(draft, texts):
    with pytest.raises(ValueError) as err:
        _create(speculative_config=DRAFT | {"model": draft})
    for text in texts:
        assert text in str(err.value), str(err.value)


@pytest.mark.parametrize("name", sorted(FOREIGN_DRAFTS))
def test_draft_must_be_dense_and_implemented(tmp_path, name):
    raw, text = FOREIGN_DRAFTS[name]
    path = _config_dir(tmp_path, name, raw, safetensors=True)
    for build in (_create, lambda **kw: EngineArgs(**kw).create_explain_config()):
        with pytest.raises(ValueError) as err:  # explain too: a draft is used, not judged
            build(model="tiny-llama", device="cpu", speculative_config=DRAFT | {"model": path})
        assert f"speculative_config.model={path!r}" in str(err.value)
        assert text in str(err.value) and "a dense model" in str(err.value)


def test_draft_positions_must_cover_max_model_len(tmp_path):
    short = _config_dir(tmp_path, "short", _preset_raw("tiny-llama-draft")
                        | {"max_position_embeddings": 256})
    spec = DRAFT | {"model": short}
    with pytest.raises(ValueError) as err:  # tiny-llama's default max_model_len is 512
        _create(speculative_config=spec, load_format="dummy")
    for text in (f"speculative_config.model={short!r}", "max_position_embeddings >= "
                 "max_model_len=512", "max_model_len <= 256", "max_position_embeddings is 256"):
        assert text in str(err.value)
    with pytest.raises(ValueError, match="max_model_len=257"):
        _create(speculative_config=spec, load_format="dummy", max_model_len=257)
    cfg = _create(speculative_config=spec, load_format="dummy", max_model_len=256)
    assert cfg.speculative_config.draft_model_config.max_model_len == 256


def test_resolved_draft_model_config(fake_cuda):
    cfg = _create(dtype="float64", max_model_len=100, speculative_config=DRAFT)
    spec = cfg.speculative_config
    assert isinstance(spec, SpeculativeSettings) and isinstance(spec, SpeculativeConfig)
    draft = spec.draft_model_config
    assert (draft.preset, draft.preset_kind, draft.dtype, draft.max_model_len) == (
        "tiny-llama-draft", "random", "float64", 100)
    assert draft.hf_config.num_hidden_layers == 1 and draft.vocab_size == 512
    assert spec.draft_weight_source == "random"
    dumped = cfg.model_dump()["speculative_config"]
    assert dumped["draft_model_config"]["model"] == "tiny-llama-draft"
    assert "hf_config" not in dumped["draft_model_config"]
    # dtype "auto" resolves once, for the target: the draft computes in the same dtype
    on_gpu = _create(device="cuda", speculative_config=DRAFT)
    assert on_gpu.speculative_config.draft_model_config.dtype == "bfloat16"
    assert on_gpu.model_config.dtype == "bfloat16"


def test_ngram_has_no_draft():
    spec = _create(model_runner="v1", speculative_config=NGRAM).speculative_config
    assert isinstance(spec, SpeculativeSettings)
    assert (spec.method, spec.draft_model_config, spec.draft_weight_source) == ("ngram", None, None)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    assert _create().speculative_config is None


# draft preset -> (target preset, load_format): the pairs DRAFT_PRESETS promises
DRAFT_PAIRS = {"tiny-llama-draft": ("tiny-llama", "auto"), "llama-3.2-1b": ("llama-3-8b", "dummy")}


@pytest.mark.parametrize("draft", sorted(DRAFT_PAIRS))
def test_draft_presets_draft_for_their_target(draft):
    target, load_format = DRAFT_PAIRS[draft]
    cfg = _create(model=target, load_format=load_format, model_runner="v2",
                  speculative_config=DRAFT | {"model": draft})
    d = cfg.speculative_config.draft_model_config
    assert d.vocab_size == cfg.model_config.vocab_size
    assert d.max_model_len == cfg.scheduler_config.max_model_len
    assert d.num_hidden_layers < cfg.model_config.num_hidden_layers
    assert d.hidden_size < cfg.model_config.hidden_size
    assert not (d.is_moe or d.is_hybrid) and d.supported_by_runnerlab


def test_draft_weights_are_checked_like_the_targets(tmp_path):
    # a safetensors target (load_format "auto") with a shape-only draft: the draft has no weights
    target = _config_dir(tmp_path, "llama3", _preset_raw("llama-3-8b"), safetensors=True)
    spec = DRAFT | {"model": "llama-3.2-1b"}
    with pytest.raises(ValueError) as err:
        _create(model=target, speculative_config=spec)
    assert str(err.value).startswith("speculative_config.model='llama-3.2-1b' (the draft): "
                                     "load_format='auto' is not valid for the shape-only preset")
    _, blockers = EngineArgs(model=target, speculative_config=spec).create_explain_config()
    assert len(blockers) == 1 and "(the draft)" in blockers[0]
    # a draft directory without weights
    bare = _config_dir(tmp_path, "bare", _preset_raw("tiny-llama-draft"))
    with pytest.raises(ValueError, match=r"\(the draft\): model=.*no \*\.safetensors"):
        _create(speculative_config=DRAFT | {"model": bare})
    cfg = _create(load_format="dummy", speculative_config=DRAFT | {"model": bare})
    assert cfg.speculative_config.draft_weight_source == "random"


# ------------------------------------------------- method x rejection rule x runner source

# source -> (EngineArgs.model_runner, RUNNERLAB_USE_V2_MODEL_RUNNER)
SOURCES = {"policy": ("auto", None), "env=0": ("auto", "0"), "env=1": ("auto", "1"),
           "model_runner=v1": ("v1", None), "model_runner=v2": ("v2", None)}
SPECS = {("ngram", "standard"): NGRAM, ("ngram", "synthetic"): NGRAM | SYNTHETIC,
         ("ngram", "block"): NGRAM | {"rejection_sample_method": "block"},
         ("draft_model", "standard"): DRAFT, ("draft_model", "synthetic"): DRAFT | SYNTHETIC,
         ("draft_model", "block"): DRAFT | {"rejection_sample_method": "block"}}

NGRAM_FALLBACK = ("V2 does not yet support ngram speculative decoding; using V1 "
                  "(set speculative_config=None to use V2)")
ENV1_NGRAM = ("Model runner V2 (chosen by RUNNERLAB_USE_V2_MODEL_RUNNER=1) does not support: "
              "ngram speculative decoding. V1 supports them: use model_runner='v1' or "
              "RUNNERLAB_USE_V2_MODEL_RUNNER=0, or set speculative_config=None.")
ARG_V2_NGRAM = ("Model runner V2 (chosen by the argument model_runner='v2') does not support: "
                "ngram speculative decoding. V1 supports them: use model_runner='v1', or set "
                "speculative_config=None.")
SPLIT = ("No model runner supports ngram speculative decoding together with "
         "rejection_sample_method='block': ngram speculative decoding is supported only by V1, "
         "rejection_sample_method='block' only by V2; drop one side: set "
         "speculative_config=None or rejection_sample_method='standard'.")
ENV0_BLOCK = ("Model runner V1 (chosen by RUNNERLAB_USE_V2_MODEL_RUNNER=0) does not support: "
              "rejection_sample_method='block'. V2 supports them: use model_runner='v2' or "
              "RUNNERLAB_USE_V2_MODEL_RUNNER=1, or set rejection_sample_method='standard'.")
ARG_V1_BLOCK = ("Model runner V1 (chosen by the argument model_runner='v1') does not support: "
                "rejection_sample_method='block'. V2 supports them: use model_runner='v2', or "
                "set rejection_sample_method='standard'.")

# (method, rule, source) -> ("run", runner, decision source, reasons[0], warnings)
#                         or ("error", the whole message)
EXPECTED = {}
for _rule in ("standard", "synthetic"):
    EXPECTED |= {
        ("ngram", _rule, "policy"): ("run", "v1", "policy", NGRAM_FALLBACK,
                                     [f"Model runner {NGRAM_FALLBACK}"]),
        ("ngram", _rule, "env=0"): ("run", "v1", "env", f"{VAR}=0", []),
        ("ngram", _rule, "env=1"): ("error", ENV1_NGRAM),
        ("ngram", _rule, "model_runner=v1"): ("run", "v1", "argument", "model_runner='v1'", []),
        ("ngram", _rule, "model_runner=v2"): ("error", ARG_V2_NGRAM),
        ("draft_model", _rule, "policy"): ("run", "v2", "policy",
                                           "dense architecture LlamaForCausalLM is eligible", []),
        ("draft_model", _rule, "env=0"): ("run", "v1", "env", f"{VAR}=0", []),
        ("draft_model", _rule, "env=1"): ("run", "v2", "env", f"{VAR}=1", []),
        ("draft_model", _rule, "model_runner=v1"): ("run", "v1", "argument", "model_runner='v1'", []),
        ("draft_model", _rule, "model_runner=v2"): ("run", "v2", "argument", "model_runner='v2'", []),
    }
EXPECTED |= {("ngram", "block", source): ("error", SPLIT) for source in SOURCES}
EXPECTED |= {
    ("draft_model", "block", "policy"): ("run", "v2", "forced",
                                         "rejection_sample_method='block' is supported only by V2", []),
    ("draft_model", "block", "env=0"): ("error", ENV0_BLOCK),
    ("draft_model", "block", "env=1"): ("run", "v2", "env", f"{VAR}=1", []),
    ("draft_model", "block", "model_runner=v1"): ("error", ARG_V1_BLOCK),
    ("draft_model", "block", "model_runner=v2"): ("run", "v2", "argument", "model_runner='v2'", []),
}


def test_the_table_covers_every_case():
    assert sorted(EXPECTED) == sorted((m, r, s) for (m, r) in SPECS for s in SOURCES)


@pytest.mark.parametrize("case", sorted(EXPECTED), ids=["-".join(c) for c in sorted(EXPECTED)])
def test_method_rule_and_source_give_the_designed_runner(monkeypatch, case):
    method, rule, source = case
    model_runner, env = SOURCES[source]
    if env is not None:
        monkeypatch.setenv(VAR, env)
    args = EngineArgs(model="tiny-llama", device="cpu", model_runner=model_runner,
                      speculative_config=SPECS[(method, rule)])
    expected = EXPECTED[case]
    if expected[0] == "error":
        with pytest.raises(RunnerSelectionError) as err:
            args.create_engine_config()
        assert str(err.value) == expected[1]
        # explain's non-strict mode records the same message instead of raising
        assert args.create_explain_config()[0].runner_decision.error == expected[1]
        return
    _, runner, decision_source, headline, warnings = expected
    decision = args.create_engine_config().runner_decision
    assert (decision.runner, decision.source) == (runner, decision_source)
    assert decision.reasons[0] == headline and decision.warnings == warnings
    assert decision.requested_features == [f"{method} speculative decoding",
                                           f"rejection_sample_method={rule!r}"]


def test_ngram_fallback_logs_the_warning_then_the_decision(caplog):
    caplog.set_level(logging.INFO, logger="runnerlab")
    _create(speculative_config=NGRAM)
    records = [r for r in caplog.records if r.name == "runnerlab"]
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.WARNING, f"Model runner {NGRAM_FALLBACK}"),
        (logging.INFO, "Model runner: V1 (runner_v1.model_runner:GPUModelRunner) — policy: "
                       f"{NGRAM_FALLBACK}"),
    ]


def test_split_features_refused_before_the_triton_gate(monkeypatch):
    from policy import selection

    monkeypatch.setattr(selection, "triton_available", lambda: False)
    with pytest.raises(RunnerSelectionError) as err:
        _create(model_runner="v2", speculative_config=SPECS[("ngram", "block")])
    assert str(err.value) == SPLIT


# --------------------------------------------------------------------------------- explain

BLOCK_JSON = json.dumps(DRAFT | {"rejection_sample_method": "block"})


def _explain(capsys, *argv):
    rc = explain_main(["--model", "tiny-llama", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_explain_block_with_v1_forced_by_env_exits_1(monkeypatch, capsys):
    monkeypatch.setenv(VAR, "0")
    rc, out, _ = _explain(capsys, "--json", "--speculative-config", BLOCK_JSON)
    report = json.loads(out)
    assert rc == 1 and report["error"] == ENV0_BLOCK
    assert (report["runner"], report["source"]) == ("v1", "env")
    assert report["unsupported_v1"] == ["rejection_sample_method='block'"]
    assert report["requested_features"] == ["draft_model speculative decoding",
                                            "rejection_sample_method='block'"]
    spec = report["speculative_config"]
    assert (spec["method"], spec["num_speculative_tokens"], spec["rejection_sample_method"]) == (
        "draft_model", 2, "block")
    assert spec["draft_model"]["model"] == "tiny-llama-draft"
    assert spec["draft_model"]["num_hidden_layers"] == 1 and spec["draft_weight_source"] == "random"


def test_explain_block_under_the_policy_is_forced_v2(capsys):
    rc, out, _ = _explain(capsys, "--json", "--speculative-config", BLOCK_JSON)
    report = json.loads(out)
    assert rc == 0 and report["error"] is None
    assert (report["runner"], report["source"]) == ("v2", "forced")


def test_explain_text_shows_the_speculative_settings(capsys):
    rc, out, _ = _explain(capsys, "--speculative-config", json.dumps(NGRAM))
    assert rc == 0
    assert "requested features: ngram speculative decoding, rejection_sample_method='standard'" in out
    assert f"warning: Model runner {NGRAM_FALLBACK}" in out
    assert ("Speculative decoding: method ngram, 2 tokens per step, rejection standard, "
            "n-grams 5..5") in out
    rc, out, _ = _explain(capsys, "--speculative-config", BLOCK_JSON)
    assert "draft: tiny-llama-draft (LlamaForCausalLM, weights random); dims: layers 1" in out


def test_explain_split_features_exits_1(capsys):
    rc, out, _ = _explain(capsys, "--json", "--speculative-config",
                          json.dumps(SPECS[("ngram", "block")]))
    assert rc == 1 and json.loads(out)["error"] == SPLIT


@pytest.mark.parametrize("spec, text", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method: Input should "
                                                       "be 'ngram' or 'draft_model' (got 'eagle')"),
    (DRAFT | {"model": "llama-3.2-1b"}, "speculative_config.model='llama-3.2-1b' is not valid"),
])
def test_explain_bad_speculative_config_exits_2(capsys, spec, text):
    rc, out, err = _explain(capsys, "--speculative-config", json.dumps(spec))
    assert rc == 2 and out == ""
    assert text in err and err.count("\n") == 1 and "Traceback" not in err
