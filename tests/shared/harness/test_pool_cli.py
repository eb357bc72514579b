"""`runnerlab embed` / `runnerlab classify`: the JSON lines equal LLM.embed's outputs;
bad flags are one-line refusals with exit status 2."""

from __future__ import annotations

import json

import torch

from shared.harness.cli import main
from shared.serving.llm import LLM

IDS = ["1,2,3,4,5", "9,8,7"]


def test_embed_json_equals_llm_embed(capsys):
    rc = main(["embed", "--model", "tiny-llama", "--dtype", "float64", "--device", "cpu",
               "--model-runner", "v1", "--pooler-config", '{"pooling_type": "MEAN"}',
               *[a for ids in IDS for a in ("--prompt-ids", ids)], "--json"])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    llm = LLM(model="tiny-llama", dtype="float64", device="cpu", model_runner="v1",
              pooling_task="embed", pooler_config={"pooling_type": "MEAN"})
    refs = llm.embed([[int(t) for t in ids.split(",")] for ids in IDS])
    assert [line["task"] for line in lines] == ["embed", "embed"]
    for line, ref in zip(lines, refs):
        assert line["shape"] == list(ref.outputs.data.shape)
        assert torch.equal(torch.tensor(line["data"], dtype=torch.float64), ref.outputs.data)


def test_refusals(capsys):
    assert main(["embed", "--model", "tiny-llama", "--device", "cpu"]) == 2
    assert "give at least one --prompt" in capsys.readouterr().err
    assert main(["classify", "--model", "tiny-llama", "--device", "cpu",
                 "--pooling-task", "embed", "--prompt-ids", "1,2"]) == 2
    assert "this command runs 'classify'" in capsys.readouterr().err
    # a causal LM has no classification head: the policy's refusal, one line
    assert main(["classify", "--model", "tiny-llama", "--device", "cpu",
                 "--prompt-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "classify" in err and "LlamaForCausalLM" in err and len(err.strip().splitlines()) == 1
