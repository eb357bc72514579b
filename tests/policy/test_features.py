"""The feature table (policy.features) against an oracle written here by hand: which
runner supports which feature, as the README and docs/design-notes.md state it. Each
feature, enabled on each runner, is accepted or refused as the oracle says (never
silently ignored), and each feature a runner supports runs on CPU with that runner and
gives the tokens of a run without it."""

import functools

import pytest
import torch

from policy import EngineArgs, RunnerSelectionError
from policy import config as config_module
from policy import features as feature_table
from policy.features import FEATURES, SUPPORTED, requested_features, unsupported_for
from tests.policy.pooling_models import SEQ_CLS, TOKEN_CLS, classifier_dir

# label -> the runners that honour it, written from the docs, not read from the table:
SUPPORTED_BY = {
    # speculative decoding, DESIGN.md section 10: ngram (prompt lookup on the host) V1 only;
    # draft_model and the standard / synthetic rules on both; block verification V2 only
    "ngram speculative decoding": {"v1"},
    "draft_model speculative decoding": {"v1", "v2"},
    "rejection_sample_method='standard'": {"v1", "v2"},
    "rejection_sample_method='synthetic'": {"v1", "v2"},
    "rejection_sample_method='block'": {"v2"},
    # each interface runs on the runner it was designed for only
    "custom logits processors (V1 interface)": {"v1"},
    "custom logits processors (V2 interface)": {"v2"},
    # pooling (vLLM): V1 pools every task; V2 embed and classify, and score built on them
    "pooling task embed": {"v1", "v2"},
    "pooling task classify": {"v1", "v2"},
    "pooling task score": {"v1", "v2"},
    "pooling task token_embed": {"v1"},
    "pooling task token_classify": {"v1"},
    # refused on both runners (design-notes "Known gaps")
    "prompt embeds": set(),
    # both runners capture piecewise graphs between the attention calls (one shared
    # implementation, design-notes "Piecewise CUDA graphs (both runners)")
    "cudagraph_mode='PIECEWISE'": {"v1", "v2"},
    "cudagraph_mode='FULL_AND_PIECEWISE'": {"v1", "v2"},
    # "both runners": V1 scatters the previous step's device tokens into its input ids
    # (placeholders on the host until they land), V2 keeps them on the device
    "async scheduling": {"v1", "v2"},
    # a draft model's proposals stay on the device in both runners, so the next step can
    # be planned before they land (V1 moves rows back on the device); ngram's are made
    # on the host from landed tokens (V1), and V2 has no ngram
    "async scheduling with draft_model speculative decoding": {"v1", "v2"},
    "async scheduling with ngram speculative decoding": set(),
    # one process, one device: no parallelism on either runner
    "tensor parallelism > 1": {"v1", "v2"},
    # both runners share the model and its kernels, where the mode lives
    "batch-invariant mode": {"v1", "v2"},
    "pipeline parallelism > 1": set(),
}


def _supports(runner, labels):
    return all(runner in SUPPORTED_BY[label] for label in labels)


def _unsupported(runner, labels):
    return [label for label in labels if runner not in SUPPORTED_BY[label]]


# label -> EngineArgs settings that turn the feature on. Adding a row to the table without
# adding it here fails test_every_feature_has_settings.
DRAFT = {"method": "draft_model", "model": "tiny-llama-draft", "num_speculative_tokens": 2}
SETTINGS = {
    "ngram speculative decoding": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    "draft_model speculative decoding": {"speculative_config": DRAFT},
    "rejection_sample_method='standard'": {
        "speculative_config": DRAFT | {"rejection_sample_method": "standard"}},
    "rejection_sample_method='synthetic'": {
        "speculative_config": DRAFT | {"rejection_sample_method": "synthetic",
                                       "synthetic_acceptance_rates": [0.9, 0.5]}},
    "rejection_sample_method='block'": {
        "speculative_config": DRAFT | {"rejection_sample_method": "block"}},
    "custom logits processors (V1 interface)": {
        "logits_processors": ["runner_v1.example_logits_processors:NoRepeatNGram"]},
    "custom logits processors (V2 interface)": {
        "logits_processors": ["runner_v2.example_logits_processors:NoRepeatNGram"]},
    "pooling task embed": {"pooling_task": "embed"},
    # the classification tasks on a model with their head (a config.json, no weights)
    "pooling task classify": {"pooling_task": "classify", "model": SEQ_CLS,
                              "load_format": "dummy"},
    "pooling task score": {"pooling_task": "score"},
    "pooling task token_embed": {"pooling_task": "token_embed"},
    "pooling task token_classify": {"pooling_task": "token_classify", "model": TOKEN_CLS,
                                    "load_format": "dummy"},
    "prompt embeds": {"enable_prompt_embeds": True},
    "cudagraph_mode='PIECEWISE'": {"cudagraph_mode": "PIECEWISE"},
    "cudagraph_mode='FULL_AND_PIECEWISE'": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
    "async scheduling": {"async_scheduling": True},
    "async scheduling with draft_model speculative decoding": {
        "async_scheduling": True, "speculative_config": DRAFT},
    "async scheduling with ngram speculative decoding": {
        "async_scheduling": True,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    "tensor parallelism > 1": {"tensor_parallel_size": 2},
    "batch-invariant mode": {"batch_invariant": True},
    "pipeline parallelism > 1": {"pipeline_parallel_size": 2},
}


def _args(label, **extra):
    # device="cuda" (faked) so that CUDA-graph features are meaningful
    kwargs = {"model": "tiny-llama", "device": "cuda"} | SETTINGS[label] | extra
    if kwargs["model"] in (SEQ_CLS, TOKEN_CLS):
        kwargs["model"] = classifier_dir(kwargs["model"])
    return EngineArgs(**kwargs)


def test_every_feature_has_settings():
    assert sorted(SETTINGS) == sorted(f.label for f in FEATURES) == sorted(SUPPORTED_BY)
    assert len({f.label for f in FEATURES}) == len(FEATURES)


def test_table_says_what_the_oracle_says():
    table = {f.label: {r for r in ("v1", "v2") if f.status(r) == SUPPORTED} for f in FEATURES}
    assert table == SUPPORTED_BY
    assert {f.status(r) for f in FEATURES for r in ("v1", "v2")} == {SUPPORTED, "unsupported-yet"}


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
    if _supports(runner, wanted):
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
    if _supports("v1", wanted):
        cfg = args.create_engine_config()
        expect_v2 = _supports("v2", wanted)
        assert cfg.use_v2_model_runner is expect_v2
        assert cfg.v2_unsupported_features() == _unsupported("v2", wanted)
    elif _supports("v2", wanted):
        # a feature only V2 has forces V2 (decision source "forced")
        cfg = args.create_engine_config()
        assert cfg.use_v2_model_runner and cfg.runner_decision.source == "forced"
        assert label in " ".join(cfg.runner_decision.reasons)
    else:
        with pytest.raises(RunnerSelectionError, match="No (model )?runner supports"):
            args.create_engine_config()


def test_async_ngram_names_the_one_setting_that_fixes_it(fake_cuda):
    """ngram needs V1 and async scheduling with ngram no runner has: the refusal asks for
    async_scheduling=False alone (with it V1 serves the config), not for dropping the
    speculation too."""
    args = _args("async scheduling with ngram speculative decoding")
    with pytest.raises(RunnerSelectionError) as err:
        args.create_engine_config()
    message = str(err.value)
    assert message.endswith("set async_scheduling=False.") and "speculative_config" not in message
    fixed = _args("async scheduling with ngram speculative decoding", async_scheduling=False)
    assert fixed.create_engine_config().runner_decision.runner == "v1"


def test_block_rejection_is_never_a_silent_no_op_on_v1(fake_cuda):
    """vLLM's V1 stores rejection_sample_method='block' and never reads it: refused here."""
    with pytest.raises(RunnerSelectionError, match="rejection_sample_method='block'"):
        _args("rejection_sample_method='block'", model_runner="v1").create_engine_config()


def test_unsupported_for_keeps_table_order():
    labels = [f.label for f in FEATURES]
    assert unsupported_for("v2", list(reversed(labels))) == list(reversed(
        [label for label in labels if "v2" not in SUPPORTED_BY[label]]))
    assert unsupported_for("v1", []) == []


def test_unknown_label():
    with pytest.raises(KeyError):
        unsupported_for("v1", ["teleportation"])


def test_table_rows():
    rows = feature_table.table()
    assert [r["feature"] for r in rows] == [f.label for f in FEATURES]
    assert all(r["v1"] in ("supported", "unsupported-yet") for r in rows)
    # the V1-only features are ngram speculative decoding, the V1 processor interface and
    # the token pooling tasks (the piecewise graphs were V1-only until V2 got them)
    assert {r["feature"] for r in rows if r["v1"] == "supported" and r["v2"] != "supported"} == {
        "ngram speculative decoding", "custom logits processors (V1 interface)",
        "pooling task token_embed", "pooling task token_classify"}


# ---- each supported feature, run on CPU with the runner that supports it ---------------
# Small runs: chunked prefills under a 32-token budget, then decodes; the oracle is the
# same engine without the feature (or V1 without async scheduling).

RUN = dict(seed=0, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
           num_gpu_blocks_override=64, enable_prefix_caching=False)
PROMPT_LENS = [3, 17, 5, 1, 9]


def _generate(engine, sampled: bool = False):
    """-> (tokens per request, (num_tokens, cudagraph_mode) per step, placeholder count)."""
    from shared.contract.sampling_params import SamplingParams

    for i, n in enumerate(PROMPT_LENS):
        temperature = 0.8 if sampled and i % 2 else 0.0
        engine.add_request(f"r{i}", [(i * 31 + j * 7) % 200 + 1 for j in range(n)],
                           SamplingParams(max_tokens=5, temperature=temperature, seed=i,
                                          ignore_eos=True))
    tokens, steps, in_flight = {}, [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        stats = engine.runner.step_stats
        steps.append((stats.num_tokens, stats.cudagraph_mode))
        in_flight += sum(r.num_output_placeholders for r in engine.scheduler.requests.values())
    return tokens, steps, in_flight


def _engine(**kw):
    from shared.serving.engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(device="cpu", **RUN, **kw))


# TRITON (interpreted): it runs in FULL graphs
GRAPHS = dict(model="tiny-qwen3", dtype="float32", attention_backend="TRITON")


@functools.cache
def _eager_tokens(runner: str):
    return _generate(_engine(model_runner=runner, **GRAPHS))[0]


def _install_graphs(engine, cuda_config):
    """Replace the CPU engine's graph manager by the one a CUDA machine builds for
    `cuda_config`; -> the runner's graph module (whose capture the stand-ins patch)."""
    runner, cuda = engine.runner, torch.device("cuda")
    if engine.runner_name == "v1":
        from runner_v1 import cudagraph as module

        runner.graphs = module.V1CudaGraphs(cuda_config, cuda, runner.executor, runner.buffers,
                                            runner.persistent_batch)
    else:
        from runner_v2 import cudagraph as module

        runner.cudagraph_manager = module.CudaGraphManager(
            cuda_config, cuda, runner.executor, runner.buffers, runner.block_tables)
    return module


def _run_graph_mode(runner: str, mode: str, monkeypatch) -> list[str]:
    """`runner` with the graphs the policy configures for `mode` on a CUDA machine,
    captured with an eager stand-in for the recording, on CPU: the tokens of the eager
    engine. -> the graph modes the steps used."""
    from tests.shared.runtime.eager_graphs import use_eager_graphs

    eager = _eager_tokens(runner)
    with monkeypatch.context() as m:  # the config the feature gets on a CUDA machine
        m.setattr(config_module, "cuda_available", lambda: True)
        cuda_config = EngineArgs(device="cuda", cudagraph_mode=mode, model_runner=runner,
                                 **RUN, **GRAPHS).create_engine_config()
    assert cuda_config.compilation_config.cudagraph_mode == mode
    assert cuda_config.runner_decision.runner == runner
    engine = _engine(model_runner=runner, **GRAPHS)
    use_eager_graphs(monkeypatch, _install_graphs(engine, cuda_config))
    engine.runner.capture_model()
    tokens, steps, _ = _generate(engine)
    assert tokens == eager
    sizes = cuda_config.compilation_config.cudagraph_capture_sizes
    graphed = [(n, m) for n, m in steps if m != "NONE"]
    assert any(n not in sizes for n, _ in graphed)  # padded replays over stale rows
    return sorted({m for _, m in graphed})


def _run_piecewise(runner: str):
    def run(monkeypatch):
        assert _run_graph_mode(runner, "PIECEWISE", monkeypatch) == ["PIECEWISE"]
    return run


def _run_full_and_piecewise(runner: str):
    def run(monkeypatch):
        # uniform decodes in FULL graphs, the mixed batches in piecewise ones
        modes = _run_graph_mode(runner, "FULL_AND_PIECEWISE", monkeypatch)
        assert modes == ["FULL", "PIECEWISE"]
    return run


def _run_async_scheduling(runner: str):
    """The runner schedules step N+1 before it reads step N's tokens: V1's tokens
    (synchronous), greedy and seeded, with tokens in flight along the way."""
    kw = dict(model="tiny-llama", dtype="float64")
    sync, _, _ = _generate(_engine(model_runner="v1", **kw), sampled=True)
    engine = _engine(model_runner=runner, async_scheduling=True, **kw)
    assert engine.async_scheduling
    tokens, _, in_flight = _generate(engine, sampled=True)
    assert tokens == sync and in_flight > 0


def _run_tp(runner: str):
    """Two gloo ranks give the one-rank tokens, greedy and seeded (the full scenario
    matrix is tests/shared/serving/test_tp_engine.py)."""
    def run(monkeypatch):
        kw = dict(model="tiny-llama", dtype="float64")
        one, _, _ = _generate(_engine(model_runner="v1", **kw), sampled=True)
        engine = _engine(model_runner=runner, tensor_parallel_size=2, **kw)
        try:
            assert len(engine.runner.worker_pids) == 1
            assert _generate(engine, sampled=True)[0] == one
        finally:
            engine.shutdown()
    return run


def _run_batch_invariant(runner: str):
    """The mode reaches the engine's kernel options and gives the float64 tokens of V1
    without it, greedy and seeded (its invariance: tests/shared/serving/
    test_batch_invariant.py)."""
    def run(monkeypatch):
        kw = dict(model="tiny-llama", dtype="float64")
        plain, _, _ = _generate(_engine(model_runner="v1", **kw), sampled=True)
        engine = _engine(model_runner=runner, batch_invariant=True, **kw)
        assert engine.config.kernel_options.batch_invariant
        assert _generate(engine, sampled=True)[0] == plain
    return run


# ---- speculative decoding: greedy equals the plain engine; the rest against each other
SPEC = dict(model="tiny-llama", dtype="float64")
# prompts that repeat themselves, so the ngram proposer finds matches
SPEC_PROMPTS = [[5, 6, 7, 8] * 3, [9, 10, 9, 10, 9], [11, 12, 13, 11, 12, 13, 11]]


def _spec_generate(engine, sampled: bool):
    from shared.contract.sampling_params import SamplingParams

    for i, prompt in enumerate(SPEC_PROMPTS):
        engine.add_request(f"s{i}", prompt, SamplingParams(
            max_tokens=8, temperature=0.8 if sampled else 0.0, seed=i, ignore_eos=True))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    return tokens, engine.spec_decode_stats


@functools.cache
def _spec_run(runner: str, spec_json: str, sampled: bool):
    import json

    spec = json.loads(spec_json)
    engine = _engine(model_runner=runner, **SPEC,
                     **({} if spec is None else {"speculative_config": spec}))
    return _spec_generate(engine, sampled)


def _spec(runner: str, sampled: bool = False, **spec):
    import json

    return _spec_run(runner, json.dumps(spec, sort_keys=True), sampled)


NGRAM = dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)
SELF_DRAFT = dict(method="draft_model", model="tiny-llama", num_speculative_tokens=2)
WEAK_DRAFT = dict(method="draft_model", model="tiny-llama-draft", num_speculative_tokens=2)


def _plain(sampled: bool = False):
    return _spec_run("v1", "null", sampled)[0]


def _run_ngram(monkeypatch):
    tokens, stats = _spec("v1", **NGRAM)
    assert tokens == _plain() and 0 < stats.num_accepted_tokens


def _run_draft_model(runner: str):
    def run(monkeypatch):
        # the target's own weights: greedy verification accepts every draft (q's argmax
        # is p's), so anything short of all of them is a bug
        tokens, stats = _spec(runner, **SELF_DRAFT)
        assert tokens == _plain() and stats.num_accepted_tokens == stats.num_draft_tokens > 0
    return run


def _run_standard(runner: str):
    def run(monkeypatch):
        other = "v2" if runner == "v1" else "v1"
        tokens, stats = _spec(runner, sampled=True, **WEAK_DRAFT)
        assert tokens == _spec(other, sampled=True, **WEAK_DRAFT)[0] and stats.num_drafts > 0
        assert _spec(runner, **WEAK_DRAFT)[0] == _plain()  # greedy: exact match
    return run


def _run_synthetic(runner: str):
    def run(monkeypatch):
        # accepted regardless of the drafts: all at rate 1, none at rate 0
        for rates, accepted in (([1.0, 1.0], 1.0), ([0.0, 0.0], 0.0)):
            _, stats = _spec(runner, **WEAK_DRAFT, rejection_sample_method="synthetic",
                             synthetic_acceptance_rates=rates)
            assert stats.num_draft_tokens > 0 and stats.acceptance_rate == accepted
    return run


def _run_block(monkeypatch):
    assert _spec("v2", **WEAK_DRAFT, rejection_sample_method="block")[0] == _plain()
    _, stats = _spec("v2", sampled=True, **SELF_DRAFT, rejection_sample_method="block")
    # q == p (the target's own weights, float64): the joint acceptance is 1 at every
    # position, so block verification accepts every draft
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def _run_async_spec(runner: str):
    return lambda monkeypatch: _async_spec(runner)


def _async_spec(runner: str):
    for spec in (SELF_DRAFT, WEAK_DRAFT):
        engine = _engine(model_runner=runner, async_scheduling=True, speculative_config=spec,
                         **SPEC)
        tokens, stats = _spec_generate(engine, sampled=False)
        assert tokens == _plain() and stats.num_draft_tokens > 0
    # Seeded: with the target's own weights every draft is accepted, so the same draws
    # decide every token and V1's synchronous engine is the oracle. With drafts that get
    # rejected the tokens differ from it (planned ahead, a step near max_tokens is
    # scheduled with fewer drafts: the in-flight ones count as accepted, which changes
    # which draws decide), so there the oracle is the target's distribution itself:
    # tests/gpu/shared/serving/test_spec_decode_statistics_gpu.py (too slow interpreted).
    engine = _engine(model_runner=runner, async_scheduling=True, speculative_config=SELF_DRAFT,
                     **SPEC)
    sampled, stats = _spec_generate(engine, sampled=True)
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert sampled == _spec("v1", sampled=True, **SELF_DRAFT)[0]


# ---- custom logits processors: each interface's example on its own runner --------------
NO_REPEAT_SIZE = 2


BOOSTED = 7


def _processor_tokens(runner: str, classes: list[str]) -> dict[str, list[int]]:
    from shared.contract.sampling_params import SamplingParams

    names = [f"runner_{runner}.example_logits_processors:{c}" for c in classes]
    engine = _engine(model="tiny-llama", dtype="float64", model_runner=runner,
                     logits_processors=names)
    # the boost makes greedy decoding repeat token 7, which the bigram ban must stop
    extra = {"no_repeat_ngram_size": NO_REPEAT_SIZE, "boost_token_ids": [BOOSTED], "boost": 50.0}
    for i, n in enumerate(PROMPT_LENS):
        engine.add_request(f"r{i}", _prompt(i, n),
                           SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                          extra_args=extra))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    return tokens


def _prompt(i: int, n: int) -> list[int]:
    return [(i * 31 + j * 7) % 200 + 1 for j in range(n)]


def _repeats_a_bigram(seq: list[int]) -> bool:
    grams = list(zip(seq, seq[1:]))
    return len(grams) != len(set(grams))


def _run_processors(runner: str):
    """The runner's own example processors: the boost alone repeats token 7; with the
    bigram ban after it no bigram of prompt + output repeats (checked in plain Python);
    and the other runner's twins on the other runner give exactly the same tokens."""
    def run(monkeypatch):
        boosted = _processor_tokens(runner, ["TargetTokenBoost"])
        assert all(t.count(BOOSTED) == len(t) for t in boosted.values())
        tokens = _processor_tokens(runner, ["TargetTokenBoost", "NoRepeatNGram"])
        for i, n in enumerate(PROMPT_LENS):
            assert not _repeats_a_bigram(_prompt(i, n) + tokens[f"r{i}"]), i
        assert tokens == _processor_tokens("v2" if runner == "v1" else "v1",
                                           ["TargetTokenBoost", "NoRepeatNGram"])
    return run


# ---- pooling: each task with its default pooler, against transformers (float64) ---------
POOL_PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]


@functools.cache
def _tiny_llama_checkpoint() -> str:
    import atexit
    import shutil
    import tempfile

    from shared.harness.hf_reference import materialize_checkpoint

    directory = tempfile.mkdtemp(prefix="runnerlab-tiny-llama-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return materialize_checkpoint("tiny-llama", 0, directory)


@torch.no_grad()
def _hf_pooling_reference(task: str, path: str) -> list[torch.Tensor]:
    """What each task's default pooler gives, from transformers: the normalised last
    hidden state (embed), every normalised hidden state (token_embed), the cosine of the
    two prompts' embeddings (score), softmax of the classifier's logits (classify, per
    prompt; token_classify, per token)."""
    import transformers

    from tests.oracles.hf_float64 import hf_oracle

    cls = {"classify": transformers.LlamaForSequenceClassification,
           "token_classify": transformers.LlamaForTokenClassification}.get(task,
                                                                             transformers.AutoModel)
    model = hf_oracle(cls.from_pretrained(path), torch.float64)
    outs = [model(torch.tensor([p])) for p in POOL_PROMPTS]
    if task in ("classify", "token_classify"):
        return [torch.softmax(o.logits[0], dim=-1) for o in outs]
    hidden = [o.last_hidden_state[0] for o in outs]
    if task == "token_embed":
        return [h / h.norm(dim=-1, keepdim=True) for h in hidden]
    last = [h[-1] / h[-1].norm() for h in hidden]
    return [torch.dot(last[0], last[1]).reshape(())] if task == "score" else last


def _run_pooling(task: str, runner: str):
    def run(monkeypatch):
        from shared.serving.llm import LLM
        from tests.policy.pooling_models import classifier_checkpoint

        architecture = {"classify": SEQ_CLS, "token_classify": TOKEN_CLS}.get(task)
        path = classifier_checkpoint(architecture) if architecture else _tiny_llama_checkpoint()
        llm = LLM(model=path, dtype="float64", device="cpu", seed=0, model_runner=runner,
                  pooling_task=task, max_model_len=64)
        assert llm.runner_name == runner
        if task == "score":
            got = [o.outputs.data for o in llm.score(POOL_PROMPTS[0], [POOL_PROMPTS[1]])]
        else:
            pooled = getattr(llm, {"embed": "embed", "classify": "classify"}.get(task, "encode"))
            got = [o.outputs.data for o in pooled(POOL_PROMPTS)]
        for g, ref in zip(got, _hf_pooling_reference(task, path), strict=True):
            assert g.shape == ref.shape and float((g - ref).abs().max()) < 1e-9, task
    return run


RUNS = {
    **{(f"pooling task {t}", r): _run_pooling(t, r)
       for t in ("embed", "classify", "score") for r in ("v1", "v2")},
    **{(f"pooling task {t}", "v1"): _run_pooling(t, "v1") for t in ("token_embed", "token_classify")},
    ("custom logits processors (V1 interface)", "v1"): _run_processors("v1"),
    ("custom logits processors (V2 interface)", "v2"): _run_processors("v2"),
    **{("cudagraph_mode='PIECEWISE'", r): _run_piecewise(r) for r in ("v1", "v2")},
    **{("cudagraph_mode='FULL_AND_PIECEWISE'", r): _run_full_and_piecewise(r) for r in ("v1", "v2")},
    ("async scheduling", "v1"): lambda monkeypatch: _run_async_scheduling("v1"),
    ("async scheduling", "v2"): lambda monkeypatch: _run_async_scheduling("v2"),
    ("ngram speculative decoding", "v1"): _run_ngram,
    **{("draft_model speculative decoding", r): _run_draft_model(r) for r in ("v1", "v2")},
    **{("rejection_sample_method='standard'", r): _run_standard(r) for r in ("v1", "v2")},
    **{("rejection_sample_method='synthetic'", r): _run_synthetic(r) for r in ("v1", "v2")},
    ("rejection_sample_method='block'", "v2"): _run_block,
    **{("async scheduling with draft_model speculative decoding", r): _run_async_spec(r)
       for r in ("v1", "v2")},
    **{("tensor parallelism > 1", r): _run_tp(r) for r in ("v1", "v2")},
    **{("batch-invariant mode", r): _run_batch_invariant(r) for r in ("v1", "v2")},
}
SUPPORTED_PAIRS = [(f.label, r) for f in FEATURES for r in ("v1", "v2") if f.status(r) == SUPPORTED]
def test_every_supported_feature_has_a_run():
    assert sorted(RUNS) == sorted(SUPPORTED_PAIRS)


@pytest.mark.parametrize("label, runner", SUPPORTED_PAIRS)
def test_supported_feature_runs_on_cpu(label, runner, monkeypatch):
    RUNS[(label, runner)](monkeypatch)
