"""Run under `torchrun --nproc-per-node 1` on a GPU: one engine through the distributed
path with a group of size 1 (NCCL device group, gloo CPU group; every all-reduce and
all-gather really called, inside the CUDA graphs too), writing its tokens, the step modes
and the backends (tests/gpu/shared/serving/test_tp_gpu.py).

    python -m torch.distributed.run --nproc-per-node 1 tp_gpu_script.py OUT.json RUNNER
"""

import json
import sys

import torch.distributed as dist

from policy import EngineArgs
from shared.contract.sampling_params import SamplingParams
from shared.serving.engine import LLMEngine

ENGINE = dict(model="tiny-qwen3", dtype="float32", device="cuda", seed=0, max_model_len=256,
              max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False,
              cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64],
              num_gpu_blocks_override=256)
# (capture sizes up to the token budget: every mixed step replays piecewise graphs; a fixed
# KV size, because the test's reference engine, in the pytest process, outlives this one and
# would otherwise count as another process's 90 % of the GPU for the next parametrisation)


def run(engine: LLMEngine) -> dict:
    for i, n in enumerate([3, 17, 5, 40, 9]):
        engine.add_request(f"r{i}", [(i * 31 + j * 7) % 500 + 1 for j in range(n)],
                           SamplingParams(max_tokens=12, temperature=0.8 if i % 2 else 0.0,
                                          seed=i, ignore_eos=True))
    tokens, modes = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        modes.append(engine.runner.step_stats.cudagraph_mode)
    return {"tokens": tokens, "modes": sorted(set(modes))}


if __name__ == "__main__":
    out_path, runner = sys.argv[1], sys.argv[2]
    engine = LLMEngine.from_engine_args(EngineArgs(model_runner=runner, **ENGINE))
    result = run(engine)
    group = engine.runner.local_runner.executor.tp_group
    result["backends"] = [dist.get_backend(group.device_group), dist.get_backend(group.cpu_group)]
    result["world_size"] = group.world_size
    engine.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)
