"""The model's piecewise split (segments between attention calls, attention eager in
between) against its normal forward, on CPU in float64 with the TORCH backend.

Two steps of a ragged batch through a paged KV cache with shuffled block ids:
  step 1: prefill A whole + the first chunk of B,
  step 2: decode A + the rest of B (a chunk after a cached prefix) + a new C.
Without padding the split must give the same numbers bit for bit (the same ops in the
same order). With a padded tail (the piecewise graphs' case: random token ids and
positions, PAD slots) the real rows must match to 1e-12, and the KV cache must change
only at the real tokens' slots.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from policy.model_config import parse_hf_config
from policy.presets import preset_config_path
from shared.attention.metadata import PAD_SLOT_ID
from shared.attention.torch_backend import TorchBackend
from shared.model import load_model
from shared.runtime.forward_context import set_forward_context
from tests.oracles.paged_attention import PagedHarness

PRESETS = ["tiny-llama", "tiny-qwen3", "tiny-mixtral", "tiny-qwen2-moe"]
BLOCK_SIZE = 4
NUM_BLOCKS = 16

# (request, tokens of this chunk, start position, block ids): decodes first
_A = [11, 12, 13, 14, 15, 16]
_B = [21, 22, 23, 24, 25, 26, 27, 28, 29]
_C = [31, 32, 33, 34]
STEPS = [
    [(_A[:5], 0, [7, 2]), (_B[:3], 0, [5, 12, 0])],
    [(_A[5:6], 5, [7, 2]), (_B[3:9], 3, [5, 12, 0]), (_C, 0, [9])],
]


def preset_model(preset: str, num_layers: int | None = None) -> torch.nn.Module:
    raw = json.loads(preset_config_path(preset).read_text())
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
    hf_config, _ = parse_hf_config(raw)
    return load_model(hf_config, load_format="dummy", dtype=torch.float64, device="cpu", seed=0)


class SplitHarness(PagedHarness):
    """PagedHarness whose KV caches start random (so a stray write shows) and can be
    swapped, so one model runs the reference and the piecewise path on twin caches."""

    def __init__(self, model) -> None:
        super().__init__(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        gen = torch.Generator().manual_seed(1)
        self.initial = [
            torch.randn(layer.kv_cache.shape, generator=gen, dtype=torch.float64)
            for layer in self.layers.values()
        ]

    def fresh_caches(self) -> list[torch.Tensor]:
        return [c.clone() for c in self.initial]

    def bind(self, caches: list[torch.Tensor]) -> None:
        for layer, cache in zip(self.layers.values(), caches):
            layer.bind_kv_cache(cache)

    def inputs(self, rows, pad: int, seed: int = 0):
        """-> (input_ids [T + pad], positions [T + pad], TORCH metadata with slot_mapping
        [T + pad], PAD past the real tokens). The padded tail gets random in-range ids
        and positions: its rows must stay in their rows whatever they hold."""
        common = self.metadata(rows)
        ids = [t for tokens, _, _ in rows for t in tokens]
        pos = [p for tokens, start, _ in rows for p in range(start, start + len(tokens))]
        gen = torch.Generator().manual_seed(seed)
        ids_t = torch.cat([torch.tensor(ids), torch.randint(0, 500, (pad,), generator=gen)])
        pos_t = torch.cat([torch.tensor(pos), torch.randint(0, 60, (pad,), generator=gen)])
        slots = torch.cat([common.slot_mapping, torch.full((pad,), PAD_SLOT_ID)])
        common = dataclasses.replace(common, slot_mapping=slots)
        md = TorchBackend().make_builder(self.device).build(common)
        return ids_t.to(torch.int32), pos_t.to(torch.int64), md


def _run(harness: SplitHarness, fn, rows, pad: int, seed: int):
    ids, pos, md = harness.inputs(rows, pad, seed)
    with torch.no_grad(), set_forward_context(md, list(harness.layers), ids.shape[0]):
        return fn(ids, pos), md.common.slot_mapping[: ids.shape[0] - pad]


def _flat_slots(cache: torch.Tensor) -> torch.Tensor:
    return cache.reshape(2, -1, cache.shape[-2] * cache.shape[-1])  # [2, slots, Hkv*D]


@pytest.fixture(scope="module", params=PRESETS)
def harness(request) -> SplitHarness:
    return SplitHarness(preset_model(request.param))


def test_split_without_padding_is_bit_identical(harness: SplitHarness) -> None:
    model = harness.model
    ref_caches, pw_caches = harness.fresh_caches(), harness.fresh_caches()
    for step, rows in enumerate(STEPS):
        harness.bind(ref_caches)
        ref, _ = _run(harness, model.forward, rows, 0, step)
        harness.bind(pw_caches)
        got, _ = _run(harness, model.forward_piecewise_eager, rows, 0, step)
        assert torch.equal(got, ref), f"step {step}: max diff {(got - ref).abs().max()}"
        for a, b in zip(ref_caches, pw_caches):
            assert torch.equal(a, b)


@pytest.mark.parametrize("pad", [1, 7])
def test_split_with_padded_tail_matches_and_writes_only_real_slots(
    harness: SplitHarness, pad: int
) -> None:
    model = harness.model
    ref_caches, pw_caches = harness.fresh_caches(), harness.fresh_caches()
    for step, rows in enumerate(STEPS):
        harness.bind(ref_caches)
        ref, _ = _run(harness, model.forward, rows, 0, step)
        before = [c.clone() for c in pw_caches]
        harness.bind(pw_caches)
        got, real_slots = _run(harness, model.forward_piecewise_eager, rows, pad, step)
        num_tokens = ref.shape[0]
        assert got.shape[0] == num_tokens + pad
        torch.testing.assert_close(got[:num_tokens], ref, rtol=0, atol=1e-12)
        untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        untouched[real_slots] = False
        for old, new, want in zip(before, pw_caches, ref_caches):
            torch.testing.assert_close(new, want, rtol=0, atol=1e-12)
            assert torch.equal(_flat_slots(new)[:, untouched], _flat_slots(old)[:, untouched])
            # and every real slot was written (it held random values before)
            assert (_flat_slots(new)[:, real_slots] != _flat_slots(old)[:, real_slots]).all()


def test_segments_follow_the_layer_structure(harness: SplitHarness) -> None:
    inner = harness.model.model
    assert inner.num_segments == len(inner.layers) + 1
    ids, pos, md = harness.inputs(STEPS[0], pad=0)
    harness.bind(harness.fresh_caches())
    with torch.no_grad(), set_forward_context(md, list(harness.layers), ids.shape[0]):
        q, k, v, residual = inner.forward_segment(0, ids, pos, None, None)
        attn = inner.layers[0].self_attn
        assert q.shape == (ids.shape[0], attn.q_size) and k.shape == v.shape
        assert k.shape == (ids.shape[0], attn.kv_size)
        # segment 0's residual stream is the embedding itself
        assert torch.equal(residual, inner.embed_tokens(ids))
    with pytest.raises(IndexError, match="segment"):
        inner.forward_segment(inner.num_segments, ids, pos, None, None)


def test_a_model_without_layers_is_one_segment() -> None:
    model = preset_model("tiny-llama", num_layers=0)
    inner = model.model
    assert inner.num_segments == 1 and len(inner.layers) == 0
    ids = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32)
    pos = torch.arange(5)
    with torch.no_grad():
        ref = model(ids, pos)
        got = model.forward_piecewise_eager(ids, pos)
        assert torch.equal(got, ref)
        assert torch.equal(ref, inner.norm(inner.embed_tokens(ids)))


def test_forward_is_unchanged_by_the_split() -> None:
    """forward() still equals a hand-written decoder over the same weights: the split
    moved code, it did not change the arithmetic (llama, one step, no cache reads)."""
    model = preset_model("tiny-llama")
    inner = model.model
    harness = SplitHarness(model)
    harness.bind(harness.fresh_caches())
    ids, pos, md = harness.inputs(STEPS[0], pad=0)
    with torch.no_grad(), set_forward_context(md, list(harness.layers), ids.shape[0]):
        got = model(ids, pos)
    harness.bind(harness.fresh_caches())
    with torch.no_grad(), set_forward_context(md, list(harness.layers), ids.shape[0]):
        h = inner.embed_tokens(ids)
        for layer in inner.layers:
            x = layer.input_layernorm(h)
            h = h + layer.self_attn(pos, x)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        want = inner.norm(h)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

