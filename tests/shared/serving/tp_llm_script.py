"""Run under `torchrun --nproc-per-node 2`: the offline LLM with tensor_parallel_size=2.
Rank 0 builds the engine and writes its outputs; rank 1's LLM(...) serves rank 0 and
exits when rank 0 shuts down (tests/shared/serving/test_tp_engine_launch.py).

    python -m torch.distributed.run --nproc-per-node 2 tp_llm_script.py OUT.json RUNNER
"""

import json
import sys

from shared.contract.sampling_params import SamplingParams
from shared.serving.llm import LLM

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(30, 52))]


def params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=8, logprobs=2),
            SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=1),
            SamplingParams(max_tokens=5)]


def outputs(llm: LLM) -> list[dict]:
    got = llm.generate(PROMPTS, params(), use_tqdm=False)
    return [{"tokens": o.outputs[0].token_ids,
             "logprobs": [{str(k): v.logprob for k, v in d.items()}
                          for d in (o.outputs[0].logprobs or [])]} for o in got]


if __name__ == "__main__":
    out_path, runner = sys.argv[1], sys.argv[2]
    llm = LLM("tiny-llama", dtype="float64", device="cpu", seed=0, model_runner=runner,
              tensor_parallel_size=2)
    result = outputs(llm)
    llm.engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)
