"""free_engines and OneEngineAtATime give an engine's memory back before they return: an
engine is a web of reference cycles (runner graphs, buffers, the scheduler's callbacks
into the engine; the tests add one of their own, so they hold whatever those become),
so it is freed by the collection inside free_engines or not until some later one, by
when the next engine has sized its KV cache to the memory left."""

from __future__ import annotations

import gc
import weakref

import pytest

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams
from shared.harness.ab_engines import OneEngineAtATime, free_engines
from shared.serving.engine import LLMEngine

ENGINE = dict(model="tiny-llama", dtype="float32", device="cpu", seed=0, max_model_len=64,
              block_size=4, num_gpu_blocks_override=32)


def _engine(runner: str) -> LLMEngine:
    engine = LLMEngine.from_engine_args(EngineArgs(model_runner=runner, **ENGINE))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # a request in flight: its state refers back to the engine
    engine._test_cycle = engine  # a cycle whatever the engine's own references become
    return engine


@pytest.fixture
def no_automatic_gc():
    """Only free_engines' own collection may free an engine here."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_an_engine_in_a_cycle_outlives_its_last_name(no_automatic_gc):
    """The premise: dropping the only name does not free an engine without a collection."""
    engine = _engine("v1")
    ref = weakref.ref(engine)
    del engine
    assert ref() is not None
    gc.collect()
    assert ref() is None


def test_free_engines_frees_every_engine_of_the_dict(no_automatic_gc):
    engines = {"v1": _engine("v1"), "v2": _engine("v2")}
    refs = [weakref.ref(e) for e in engines.values()]
    free_engines(engines)
    assert engines == {}
    assert [r() for r in refs] == [None, None]


def test_one_engine_at_a_time_frees_the_live_engine_before_the_next_build(no_automatic_gc):
    refs: dict[str, weakref.ref] = {}
    alive_at_build: list[list[str]] = []

    def builder(runner: str):
        def build() -> LLMEngine:
            alive_at_build.append([k for k, r in refs.items() if r() is not None])
            engine = _engine(runner)
            refs[runner] = weakref.ref(engine)
            return engine
        return build

    engines = OneEngineAtATime({"v1": builder("v1"), "v2": builder("v2")})
    assert engines["v1"].has_unfinished_requests()
    assert engines["v2"].has_unfinished_requests()
    free_engines(engines)
    assert alive_at_build == [[], []]
    assert refs["v2"]() is None and engines.builds == {"v1": 1, "v2": 1}
