"""The differential harness behind `runnerlab diff` (its command line: diff_cli.py):
build each engine of a comparison (V1, V2, their async-scheduling and TP twins, Hugging
Face, a solo run), run a scenario through every one and compare each pair.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

from shared.harness.compare import PairReport, compare_runs
from shared.harness.scenario_run import RequestRecord, ScenarioRun, run_scenario, run_solo
from shared.harness.scenarios import Scenario, build_scenario

RUNNERS = ("v1", "v2", "v1-async", "v2-async")
ENGINES = (*RUNNERS, "hf", "solo")
# `--tensor-parallel-size N` gives every runner engine a twin `<engine>-tpN`, run with
# that many ranks and compared with every other engine like a runner.
_TP_SUFFIX = re.compile(r"^(?P<engine>.+)-tp(?P<size>[0-9]+)$")


def split_engine(name: str) -> tuple[str, int]:
    """'v2-async-tp2' -> ('v2-async', 2); 'v1' -> ('v1', 1)."""
    m = _TP_SUFFIX.match(name)
    return (m["engine"], int(m["size"])) if m else (name, 1)


def is_runner(name: str) -> bool:
    return split_engine(name)[0] in RUNNERS


def with_tp_twins(engines: list[str], tensor_parallel_size: int) -> list[str]:
    if tensor_parallel_size == 1:
        return engines
    twins = [f"{e}-tp{tensor_parallel_size}" for e in engines if e in RUNNERS]
    return list(dict.fromkeys([*engines, *twins]))
DEFAULT_ENGINES = "v1,v2,hf,solo"
# |logprob| tolerance between runners (and a runner and its solo run): both share the
# model and attention backend, so float64 agrees to rounding.
LOGPROB_TOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
# transformers computes RMSNorm and RoPE in float32 even in a float64 model.
HF_LOGPROB_TOL = {"float64": 1e-5, "float32": 1e-4, "bfloat16": 1e-1, "float16": 5e-2}


# ---------------------------------------------------------------- running scenarios


@dataclass
class ScenarioReport:
    name: str
    seed: int
    summary: str
    greedy: bool
    seeded: bool
    engines: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    expects: list[str] = field(default_factory=list)
    events: dict[str, int] = field(default_factory=dict)
    missing_events: list[str] = field(default_factory=list)
    leaked_blocks: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    pairs: list[PairReport] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return (self.error is None and not self.missing_events
                and not any(self.leaked_blocks.values()) and all(p.agrees for p in self.pairs))


@dataclass
class DiffSetup:
    model: str  # what the user asked for
    model_path: str  # what the engines load (a materialised checkpoint for random presets)
    dtype: str
    device: str
    seed: int
    engines: list[str]
    hf: Any = None  # HFGreedy, when the model is supported and `hf` was asked for
    hf_skip_reason: str | None = None
    logprob_tol: float = 1e-9
    hf_logprob_tol: float = 1e-5
    batch_invariant: bool = False  # every engine in batch-invariant mode


def build_engine(setup: DiffSetup, runner: str, engine_kwargs: dict[str, Any]):
    from policy import EngineArgs
    from shared.serving.engine import LLMEngine

    name, tp = split_engine(runner)
    runner, _, mode = name.partition("-")  # "v1-async": V1 with async scheduling
    kwargs = dict(engine_kwargs)
    if mode == "async":
        kwargs["async_scheduling"] = True
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
    if setup.batch_invariant:
        kwargs["batch_invariant"] = True
    return LLMEngine.from_engine_args(EngineArgs(
        model=setup.model_path, dtype=setup.dtype, device=setup.device, seed=setup.seed,
        model_runner=runner, **kwargs,
    ))


def run_one(setup: DiffSetup, scenario: Scenario) -> ScenarioReport:
    """Run one scenario through every engine of `setup` and compare."""
    report = ScenarioReport(scenario.name, setup.seed, scenario.summary, scenario.greedy,
                            scenario.seeded, expects=list(scenario.expects))
    runs: dict[str, ScenarioRun] = {}
    try:
        _run_engines(setup, scenario, report, runs)
    except Exception as exc:  # an engine crash is a finding, reported with its scenario
        report.error = f"{report.engines[-1]}: {type(exc).__name__}: {exc}"
    runners = [e for e in setup.engines if is_runner(e) and e in runs]
    if runners:
        first = runs[runners[0]]
        report.events = first.events()
        report.missing_events = first.missing_events(scenario.expects)
    report.pairs = _pairs(setup, runs, runners)
    return report


def _run_engines(
    setup: DiffSetup, scenario: Scenario, report: ScenarioReport, runs: dict[str, ScenarioRun]
) -> None:
    """Fills `runs` engine by engine (what ran before a crash is still compared)."""
    runners = [e for e in setup.engines if is_runner(e)]
    for runner in runners:
        report.engines.append(runner)
        engine = build_engine(setup, runner, scenario.engine_kwargs())
        try:
            runs[runner] = run_scenario(engine, scenario)
            report.leaked_blocks[runner] = (
                engine.num_total_kv_blocks() - engine.num_free_kv_blocks())
        finally:
            engine.shutdown()  # a TP engine's workers and group: the next one needs its own
    if "solo" in setup.engines:
        if scenario.solo and runners:
            report.engines.append("solo")
            engine = build_engine(setup, runners[0], scenario.solo_engine_kwargs())
            runs["solo"] = run_solo(engine, scenario)
            report.leaked_blocks["solo"] = (
                engine.num_total_kv_blocks() - engine.num_free_kv_blocks())
        else:
            report.skipped["solo"] = "the scenario declares no solo reference"
    if "hf" in setup.engines:
        if setup.hf is None:
            report.skipped["hf"] = setup.hf_skip_reason or "unsupported"
        elif not scenario.greedy:
            report.skipped["hf"] = "not a greedy scenario"
        elif runners:
            report.engines.append("hf")
            runs["hf"] = run_hf(setup.hf, scenario, runs[runners[0]])


def run_hf(hf: Any, scenario: Scenario, reference: ScenarioRun) -> ScenarioRun:
    from shared.harness.hf_reference import hf_comparable

    records: dict[str, RequestRecord] = {}
    for label, add in scenario.labelled_adds().items():
        produced = reference.requests.get(label)
        if produced is None or not produced.token_ids or not hf_comparable(add.params):
            continue
        tokens, logprobs = hf.generate(list(add.prompt_token_ids), len(produced.token_ids))
        records[label] = RequestRecord(
            tokens, [{t: lp} for t, lp in zip(tokens, logprobs)], finish_reason=None
        )
    return ScenarioRun(records, [], 0, 0)


def _pairs(setup: DiffSetup, runs: dict[str, ScenarioRun], runners: list[str]):
    pairs = []
    for i, a in enumerate(runners):
        for b in runners[i + 1:]:
            pairs.append(compare_runs(a, runs[a].requests, b, runs[b].requests,
                                      setup.logprob_tol, reference=False,
                                      in_flight="async" in a or "async" in b))
    for ref in ("hf", "solo"):
        if ref in runs:
            tol = setup.hf_logprob_tol if ref == "hf" else setup.logprob_tol
            pairs += [compare_runs(a, runs[a].requests, ref, runs[ref].requests, tol, True)
                      for a in runners]
    return pairs


def prepare(model: str, dtype: str, device: str, seed: int, engines: list[str],
            workdir: str, hf_cache: dict[str, Any]) -> DiffSetup:
    """Where the engines load from and the HF reference, for one seed."""
    from shared.harness import hf_reference as hfr

    setup = DiffSetup(model, model, dtype, device, seed, engines,
                      logprob_tol=LOGPROB_TOL.get(dtype, 1e-4),
                      hf_logprob_tol=HF_LOGPROB_TOL.get(dtype, 1e-4))
    if "hf" not in engines:
        return setup
    if not hfr.hf_supports(model):
        setup.hf_skip_reason = f"transformers is not a reference for model={model!r}"
        return setup
    if model == "smollm2-135m":
        # transformers' GGUF path keeps its weights packed and its matmuls in float32
        setup.hf_logprob_tol = max(setup.hf_logprob_tol, HF_LOGPROB_TOL["float32"])
    if hfr.is_random_preset(model):
        setup.model_path = hfr.materialize_checkpoint(model, seed, f"{workdir}/{model}-seed{seed}")
    if setup.model_path not in hf_cache:
        hf_cache[setup.model_path] = hfr.HFGreedy(setup.model_path, dtype, device)
    setup.hf = hf_cache[setup.model_path]
    return setup


def vocab_size_of(model: str) -> int:
    from policy.model_config import read_config_json, resolve_model_source

    _, config_path, _ = resolve_model_source(model)
    raw = read_config_json(config_path, model)
    return int(raw.get("vocab_size") or raw["text_config"]["vocab_size"])


def run_diff(model: str, dtype: str, device: str, scenarios: list[str], seeds: list[int],
             engines: list[str], logprob_tol: float | None = None,
             batch_invariant: bool = False) -> list[ScenarioReport]:
    """Every scenario for every seed through `engines`; one report per (seed, scenario).
    batch_invariant: every engine in that mode, and runners compared bitwise unless
    logprob_tol says otherwise."""
    if batch_invariant and logprob_tol is None:
        logprob_tol = 0.0
    reports = []
    hf_cache: dict[str, Any] = {}
    vocab = vocab_size_of(model)
    with tempfile.TemporaryDirectory(prefix="runnerlab-diff-") as workdir:
        for seed in seeds:
            setup = prepare(model, dtype, device, seed, engines, workdir, hf_cache)
            setup.batch_invariant = batch_invariant
            if logprob_tol is not None:
                setup.logprob_tol = logprob_tol
            for name in scenarios:
                reports.append(run_one(setup, build_scenario(name, seed, vocab)))
    return reports
