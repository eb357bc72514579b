"""The feature table is the single source of truth: each feature, enabled on each runner,
is accepted or refused exactly as the table says, and never silently ignored."""

import pytest

from policy import EngineArgs, RunnerSelectionError
from policy import features as feature_table
from policy.features import FEATURES, SUPPORTED, requested_features, unsupported_for

# label -> EngineArgs settings that turn the feature on. Adding a row to the table without
# adding it here fails test_every_feature_has_settings.
SETTINGS = {
    "speculative decoding": {"speculative_config": {"method": "eagle"}},
    "rejection_sample_method='block'": {
        "speculative_config": {"method": "eagle", "rejection_sample_method": "block"}},
    "custom logits processors": {"logits_processors": ["my_pkg.procs:NoRepeat"]},
    "pooling": {"pooling_task": "embed"},
    "prompt embeds": {"enable_prompt_embeds": True},
    "cudagraph_mode='PIECEWISE'": {"cudagraph_mode": "PIECEWISE"},
    "cudagraph_mode='FULL_AND_PIECEWISE'": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
    "async scheduling": {"async_scheduling": True},
    "tensor parallelism > 1": {"tensor_parallel_size": 2},
    "pipeline parallelism > 1": {"pipeline_parallel_size": 2},
}


def _args(label, **extra):
    # device="cuda" (faked) so that CUDA-graph features are meaningful
    return EngineArgs(model="tiny-llama", device="cuda", **SETTINGS[label], **extra)


def test_every_feature_has_settings():
    assert sorted(SETTINGS) == sorted(f.label for f in FEATURES)
    assert len({f.label for f in FEATURES}) == len(FEATURES)


@pytest.mark.parametrize("label", sorted(SETTINGS))
def test_settings_request_the_feature(label):
    assert label in requested_features(_args(label))


def test_default_args_request_nothing():
    assert requested_features(EngineArgs(model="tiny-llama")) == []


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("label", sorted(SETTINGS))
def test_runner_honours_or_refuses_as_the_table_says(fake_cuda, label, runner):
    args = _args(label, model_runner=runner)
    wanted = requested_features(args)
    if all(feature_table.feature(f).status(runner) == SUPPORTED for f in wanted):
        cfg = args.create_engine_config()
        assert cfg.runner_decision.runner == runner
        assert label in cfg.requested_features()
    else:
        with pytest.raises(RunnerSelectionError) as err:
            args.create_engine_config()
        assert label in str(err.value) and feature_table.feature(label).drop in str(err.value)


@pytest.mark.parametrize("label", sorted(SETTINGS))
def test_auto_falls_back_or_refuses(fake_cuda, label):
    args = _args(label)
    wanted = requested_features(args)
    if not unsupported_for("v1", wanted):
        cfg = args.create_engine_config()
        expect_v2 = not unsupported_for("v2", wanted)
        assert cfg.use_v2_model_runner is expect_v2
        assert cfg.v2_unsupported_features() == unsupported_for("v2", wanted)
    elif not unsupported_for("v2", wanted):
        # a feature only V2 has forces V2 (decision source "forced")
        cfg = args.create_engine_config()
        assert cfg.use_v2_model_runner and cfg.runner_decision.source == "forced"
        assert label in " ".join(cfg.runner_decision.reasons)
    else:
        with pytest.raises(RunnerSelectionError, match="No model runner supports"):
            args.create_engine_config()


def test_block_rejection_is_never_a_silent_no_op_on_v1(fake_cuda):
    """vLLM's V1 stores rejection_sample_method='block' and never reads it: refused here."""
    with pytest.raises(RunnerSelectionError, match="rejection_sample_method='block'"):
        _args("rejection_sample_method='block'", model_runner="v1").create_engine_config()


def test_unsupported_for_keeps_table_order():
    labels = [f.label for f in FEATURES]
    assert unsupported_for("v2", list(reversed(labels))) == list(reversed(
        [f.label for f in FEATURES if f.v2 != SUPPORTED]))
    assert unsupported_for("v1", []) == []


def test_unknown_label():
    with pytest.raises(KeyError):
        unsupported_for("v1", ["teleportation"])


def test_table_rows():
    rows = feature_table.table()
    assert [r["feature"] for r in rows] == [f.label for f in FEATURES]
    assert all(r["v1"] in ("supported", "unsupported-yet") for r in rows)
    assert {r["feature"] for r in rows if r["v1"] == "supported" and r["v2"] != "supported"} == {
        "cudagraph_mode='PIECEWISE'", "cudagraph_mode='FULL_AND_PIECEWISE'"}
