"""Custom logits processors: resolve the qualified names in `logits_processors` and say
which runner interface each class implements.

The two runners keep per-request state differently, and so do their processor interfaces:
- V1 interface (runner_v1/logits_processor.py, BatchUpdateLogitsProcessor): rows of the
  dense batch move (condense, reordering), so a processor is told every add / remove /
  move through `update_state(batch_update)`, then `apply(logits)` runs over the dense
  batch; `is_argmax_invariant()` lets greedy batches skip it.
- V2 interface (runner_v2/logits_processor.py, SlotLogitsProcessor): a request keeps one
  permanent slot, so `add_request(slot, params)`, `remove_request(slot)` and
  `apply(logits, idx_mapping)` over the gathered batch; there are no moves.

The interface is read from the class's methods (an ABC from either runner module is the
convenient way to get them right, but is not required). Only the names listed in
`logits_processors` are loaded: nothing installed in the environment adds a processor,
or changes the runner, by itself (vLLM switches runners when any installed package
registers a processor entry point).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Literal

from pydantic import BaseModel, ConfigDict

Interface = Literal["v1", "v2"]

V1_METHODS = ("update_state", "apply", "is_argmax_invariant")
V2_METHODS = ("add_request", "remove_request", "apply")


class LogitsProcessorSpec(BaseModel):
    """One resolved entry of `logits_processors`."""

    model_config = ConfigDict(frozen=True)

    name: str  # as the user wrote it
    qualname: str  # "package.module:Class"
    interface: Interface

    def describe(self) -> str:
        return f"{self.name} ({self.interface.upper()} interface)"


def _import(name: str) -> type:
    """'package.module:Class' or 'package.module.Class' -> the class."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"logits_processors entry {name!r} is not a qualified class name; pass "
            "'package.module:Class' or 'package.module.Class'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"logits_processors entry {name!r}: cannot import module {module_name!r} ({exc}); "
            "install it or fix the name"
        ) from exc
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls):
        raise ValueError(
            f"logits_processors entry {name!r}: module {module_name!r} has no class {attr!r}"
        )
    return cls


def _has(cls: type, method: str) -> bool:
    return callable(getattr(cls, method, None))


def interface_of(cls: type, name: str) -> Interface:
    """Which runner interface `cls` implements; a ValueError naming what is missing when
    it implements neither (or is still abstract), or when it implements both."""
    full = {i: all(_has(cls, m) for m in (V1_METHODS if i == "v1" else V2_METHODS))
            for i in ("v1", "v2")}
    if full["v1"] and full["v2"]:
        raise ValueError(
            f"logits_processors entry {name!r} implements both the V1 interface "
            f"({', '.join(V1_METHODS)}) and the V2 interface ({', '.join(V2_METHODS)}); "
            "runnerlab cannot tell which state protocol it follows: split it into two classes"
        )
    found = [i for i in ("v1", "v2") if full[i]]
    if not found:
        missing_v1 = [m for m in V1_METHODS if not _has(cls, m)]
        missing_v2 = [m for m in V2_METHODS if not _has(cls, m)]
        raise ValueError(
            f"logits_processors entry {name!r} implements neither processor interface: the V1 "
            f"interface (runner_v1.logits_processor.BatchUpdateLogitsProcessor) lacks "
            f"{', '.join(missing_v1)}; the V2 interface "
            f"(runner_v2.logits_processor.SlotLogitsProcessor) lacks {', '.join(missing_v2)}"
        )
    interface = found[0]
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        raise ValueError(
            f"logits_processors entry {name!r} is abstract: implement {', '.join(abstract)}"
        )
    return interface


@functools.cache
def _resolve_one(name: str) -> LogitsProcessorSpec:
    if not isinstance(name, str) or not name:
        raise ValueError(f"logits_processors entry {name!r} must be a non-empty str")
    cls = _import(name)
    qualname = f"{cls.__module__}:{cls.__qualname__}"
    return LogitsProcessorSpec(name=name, qualname=qualname, interface=interface_of(cls, name))


def resolve_logits_processors(names: list[str]) -> list[LogitsProcessorSpec]:
    """Every entry resolved (import + interface), in order; duplicates refused."""
    specs = [_resolve_one(n) for n in names]
    seen: set[str] = set()
    for spec in specs:
        if spec.qualname in seen:
            raise ValueError(
                f"logits_processors lists {spec.qualname!r} twice; each class runs once per step"
            )
        seen.add(spec.qualname)
    return specs


def load_class(spec: LogitsProcessorSpec) -> type:
    """The class a resolved spec names (the runners instantiate it)."""
    return _import(spec.qualname)


def interfaces(names_or_specs: list) -> set[Interface]:
    """The interfaces a `logits_processors` value uses (names are resolved)."""
    specs = [s if isinstance(s, LogitsProcessorSpec) else _resolve_one(s) for s in names_or_specs]
    return {s.interface for s in specs}


def describe(names_or_specs: list) -> str:
    specs = [s if isinstance(s, LogitsProcessorSpec) else _resolve_one(s) for s in names_or_specs]
    return ", ".join(s.describe() for s in specs)
