"""V2 runs on a CPU-only machine whatever was imported before `shared`.

Each case is a fresh interpreter (the import order is process state), with
TRITON_INTERPRET unset, as a user's script has it. The child runs the same requests
through V2 and V1; V1 uses no Triton kernel on CPU, so it is the oracle: seeded
sampling gives identical tokens in both runners (greedy, and random with top-k/top-p,
which go through Triton's library functions: zeros, sums, argmax, sorts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")

CHILD = r"""
import json, sys
{first_import}
from shared import LLM, SamplingParams

params = [SamplingParams(max_tokens=4, temperature=0.0),
          SamplingParams(max_tokens=4, temperature=0.8, top_k=20, top_p=0.9, seed=7)]
prompts = [[1, 2, 3], [4, 5, 6, 7]]
tokens = {{}}
for runner in ("v2", "v1"):
    llm = LLM(model="tiny-llama", dtype="float32", device="cpu", seed=0, model_runner=runner)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens[runner] = [o.outputs[0].token_ids for o in outs]
print("RESULT " + json.dumps(tokens))
"""

ORDERS = {
    "triton": "import triton",
    "triton_language": "import triton.language as tl",
    "transformers": "import transformers",
    "transformers_llama": "from transformers import LlamaForCausalLM",
}


def _run_child(first_import: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(first_import=first_import)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return proc, json.loads(lines[-1][len("RESULT "):]) if lines else {}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_v2_runs_after_import(order: str) -> None:
    proc, tokens = _run_child(ORDERS[order])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tokens["v2"] == tokens["v1"]
    assert all(len(t) == 4 for t in tokens["v2"])


def test_late_switch_is_logged() -> None:
    """The switch is visible: the interpreter line and the re-decoration line both show
    (the runnerlab logger is configured before either is emitted)."""
    proc, _ = _run_child("import triton")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Triton interpreter" in proc.stderr
    assert "imported before runnerlab" in proc.stderr
