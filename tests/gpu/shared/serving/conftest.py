"""What the engine-level GPU tests share: a seeded tiny-llama checkpoint (transformers can
load it: the oracle's weights are the engine's) and the float32 CUDA setup of both runners."""

from __future__ import annotations

import pytest

from shared.harness.diff import DiffSetup
from shared.harness.hf_reference import materialize_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return materialize_checkpoint("tiny-llama", 0, str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def setup(llama_dir) -> DiffSetup:
    return DiffSetup("tiny-llama", llama_dir, "float32", "cuda", 0, ["v1", "v2"])
