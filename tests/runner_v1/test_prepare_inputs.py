"""V1 input prep against the seeds' worked examples and a per-token Python oracle."""

import numpy as np
import pytest

from runner_v1.persistent_batch import PersistentBatch
from runner_v1.prepare_inputs import (
    InputBuffers,
    compute_req_indices,
    cumsum_and_arange,
    prepare_inputs,
)
from runner_v1.request_state import CachedRequestState
from shared.attention.metadata import PAD_SLOT_ID
from shared.contract.sampling_params import SamplingParams


def make_batch(max_num_reqs, max_model_len, max_tokens, block_size, device="cpu"):
    batch = PersistentBatch(max_num_reqs, max_model_len, max_tokens, 1000, block_size, device)
    buffers = InputBuffers(max_num_reqs, max_tokens, device)
    return batch, buffers


def add(batch, req_id, tokens, num_computed, block_ids):
    batch.add_request(CachedRequestState(
        req_id=req_id, prompt_token_ids=list(tokens), prompt_len=len(tokens),
        sampling_params=SamplingParams(seed=0), eos_token_id=None,
        block_ids=list(block_ids), num_computed_tokens=num_computed,
    ))


def test_seed_worked_example_2_5_3():
    num_scheduled = np.array([2, 5, 3], dtype=np.int32)
    arange = np.arange(16, dtype=np.int32)
    query_pos = np.full(16, -1, dtype=np.int32)
    req_indices = compute_req_indices(num_scheduled, arange)
    cu = cumsum_and_arange(num_scheduled, arange, query_pos)
    assert req_indices.tolist() == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    assert cu.tolist() == [2, 7, 10]
    assert query_pos[:10].tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
    assert (query_pos[10:] == -1).all()  # nothing written past the real tokens
    num_computed = np.array([4, 0, 9])
    assert (num_computed[req_indices] + query_pos[:10]).tolist() == [
        4, 5, 0, 1, 2, 3, 4, 9, 10, 11]


def test_seed_cpu_oracle_empty_row_mixed_lengths_padding():
    """Query lengths [2, 0, 1, 3], prefixes [5, 0, 12, 1], block size 8, padded to 8
    tokens and 6 rows."""
    batch, buffers = make_batch(6, 16, 8, 8)
    prompts = [list(range(100, 107)), [], list(range(200, 213)), list(range(300, 304))]
    for i, (tokens, computed, blocks) in enumerate(
            zip(prompts, [5, 0, 12, 1], [[2, 3], [4, 5], [6, 7], [8, 9]])):
        add(batch, f"r{i}", tokens, computed, blocks)
    out = prepare_inputs(batch, np.array([2, 0, 1, 3], np.int32), buffers,
                         num_tokens_padded=8, num_reqs_padded=6)
    assert out.query_start_loc.tolist() == [0, 2, 2, 3, 6, 6, 6]
    assert out.seq_lens.tolist() == [7, 0, 13, 4, 0, 0]
    assert out.slot_mapping.tolist() == [21, 22, 60, 65, 66, 67, PAD_SLOT_ID, PAD_SLOT_ID]
    assert out.positions.tolist() == [5, 6, 12, 1, 2, 3, 0, 0]
    assert out.input_ids.tolist() == [105, 106, 212, 301, 302, 303, 0, 0]
    assert out.logits_indices.tolist() == [1, 1, 2, 5]
    assert (out.num_tokens, out.num_tokens_padded, out.num_reqs_padded) == (6, 8, 6)
    assert (out.max_query_len, out.max_seq_len, out.num_decodes) == (3, 13, 0)


def test_seed_decode_batch_block_size_16():
    """Four decodes with num_computed 1000, 512, 37, 2047 (the English seed's example)."""
    batch, buffers = make_batch(4, 2048, 16, 16)
    computed = [1000, 512, 37, 2047]
    for i, c in enumerate(computed):
        add(batch, f"d{i}", [i] * (c + 1), c, list(range(1000 * i, 1000 * i + c // 16 + 1)))
    out = prepare_inputs(batch, np.ones(4, np.int32), buffers)
    assert out.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert out.positions.tolist() == computed
    assert out.seq_lens.tolist() == [1001, 513, 38, 2048]
    assert out.logits_indices.tolist() == [0, 1, 2, 3]
    assert out.input_ids.tolist() == [0, 1, 2, 3]
    assert (out.num_decodes, out.num_decode_tokens, out.max_query_len) == (4, 4, 1)
    expected_slots = [(1000 * i + c // 16) * 16 + c % 16 for i, c in enumerate(computed)]
    assert out.slot_mapping.tolist() == expected_slots


def oracle(requests, num_scheduled, block_size):
    """Per-token Python loops: the independent reference."""
    qsl, seq_lens, positions, input_ids, slots, logits = [0], [], [], [], [], []
    for (tokens, computed, blocks), n in zip(requests, num_scheduled):
        for q in range(n):
            pos = computed + q
            positions.append(pos)
            input_ids.append(tokens[pos])
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + n)
        seq_lens.append(computed + n)
        logits.append(qsl[-1] - 1)
    return qsl, seq_lens, positions, input_ids, slots, logits


def random_step(rng, batch, buffers, num_reqs, block_size, prefix):
    requests = []
    for i in range(num_reqs):
        length = int(rng.integers(1, 30))
        tokens = rng.integers(0, 1000, size=length).tolist()
        computed = int(rng.integers(0, length))
        blocks = rng.integers(1, 500, size=-(-length // block_size)).tolist()
        add(batch, f"{prefix}{i}", tokens, computed, blocks)
        requests.append((tokens, computed, blocks))
    num_scheduled = [int(rng.integers(1, len(t) - c + 1)) for t, c, _ in requests]
    return requests, num_scheduled


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_oracle_and_pads_after_a_larger_step(seed):
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 4, 16]))
    R, T = 8, 256
    batch, buffers = make_batch(R, 32, T, block_size)
    for step, num_reqs in enumerate([R, int(rng.integers(1, R))]):  # big step, then small
        for req_id in list(batch.req_id_to_index):
            batch.remove_request(req_id)
        batch.condense()
        requests, num_scheduled = random_step(rng, batch, buffers, num_reqs, block_size, step)
        num_tokens = sum(num_scheduled)
        padded_tokens = num_tokens + int(rng.integers(0, 8))
        padded_reqs = int(rng.integers(num_reqs, R + 1))
        out = prepare_inputs(batch, np.array(num_scheduled, np.int32), buffers,
                             padded_tokens, padded_reqs)
        qsl, seq_lens, positions, input_ids, slots, logits = oracle(
            requests, num_scheduled, block_size)
        pad_t, pad_r = padded_tokens - num_tokens, padded_reqs - num_reqs
        assert out.query_start_loc.tolist() == qsl + [qsl[-1]] * pad_r
        assert out.query_start_loc_cpu.tolist() == out.query_start_loc.tolist()
        assert out.seq_lens.tolist() == seq_lens + [0] * pad_r
        assert out.seq_lens_cpu.tolist() == out.seq_lens.tolist()
        assert out.positions.tolist() == positions + [0] * pad_t
        assert out.positions_np.tolist() == positions
        assert out.input_ids.tolist() == input_ids + [0] * pad_t
        assert out.slot_mapping.tolist() == slots + [PAD_SLOT_ID] * pad_t
        assert out.logits_indices.tolist() == logits == out.logits_indices_np.tolist()
        assert out.max_query_len == max(num_scheduled)
        assert out.max_seq_len == max(seq_lens)
        # Whole persistent host buffers: nothing stale survives past the real rows.
        assert (np.diff(buffers.query_start_loc.np) >= 0).all()
        assert not buffers.seq_lens.np[num_reqs:].any()
        assert (batch.block_table.slot_mapping.np[num_tokens:] == PAD_SLOT_ID).all()
        # The committed device block table: live rows copied, later rows zero.
        device_table = batch.block_table.block_table.gpu
        np.testing.assert_array_equal(device_table[:num_reqs].numpy(),
                                      batch.block_table.np[:num_reqs])
        assert not device_table[num_reqs:].any()


def test_common_attn_metadata():
    batch, buffers = make_batch(4, 16, 16, 4)
    add(batch, "a", list(range(9)), 8, [3, 4, 5])
    add(batch, "b", list(range(5)), 0, [6, 7])
    out = prepare_inputs(batch, np.array([1, 5], np.int32), buffers, 8, 3)
    md = out.common_attn_metadata(batch.block_table.block_table.gpu, 4)
    assert md.block_table.shape == (3, 4) and not md.block_table[2].any()
    assert md.block_table[:2].tolist() == [[3, 4, 5, 0], [6, 7, 0, 0]]
    assert (md.num_reqs, md.num_actual_tokens, md.num_decodes, md.num_prefills) == (2, 6, 1, 1)
    assert md.num_reqs_padded == 3 and md.slot_mapping.shape == (8,)


def test_rejects_holes_empty_batches_and_bad_padding():
    batch, buffers = make_batch(4, 16, 16, 4)
    with pytest.raises(ValueError, match="no rows"):
        prepare_inputs(batch, np.zeros(0, np.int32), buffers)
    add(batch, "a", [1, 2], 0, [1])
    add(batch, "b", [1, 2], 0, [2])
    with pytest.raises(ValueError, match="num_tokens_padded"):
        prepare_inputs(batch, np.array([2, 2], np.int32), buffers, num_tokens_padded=3)
    with pytest.raises(ValueError, match="num_reqs_padded"):
        prepare_inputs(batch, np.array([2, 2], np.int32), buffers, num_reqs_padded=5)
    batch.remove_request("a")
    with pytest.raises(ValueError, match="condensed"):
        prepare_inputs(batch, np.array([2], np.int32), buffers)


def test_scheduling_past_the_known_tokens_is_a_clear_error():
    """A row scheduled beyond the tokens the batch holds would read a stale token; the
    error names the request and the counts instead of a bare assertion."""
    batch, buffers = make_batch(4, 16, 8, 8)
    add(batch, "r0", [5, 6, 7], 2, [1])
    with pytest.raises(RuntimeError, match=r"'r0' \(row 0\) is scheduled up to position 4 .* only 3"):
        prepare_inputs(batch, np.array([2], np.int32), buffers)


def test_clear_forgets_every_row_and_records_the_removals():
    batch, _ = make_batch(4, 16, 8, 8)
    for i in range(3):
        add(batch, f"r{i}", [1, 2, 3], 0, [i + 1])
    batch.refresh_sampling_metadata()  # consume the adds
    batch.clear()
    assert batch.num_reqs == 0 and batch.req_ids == [] and batch.req_id_to_index == {}
    assert (batch.block_table.num_blocks_per_row == 0).all()
    add(batch, "r9", [4, 5], 0, [7])
    assert batch.req_id_to_index == {"r9": 0}
    update = batch.batch_update_builder.get_and_reset(batch.num_reqs)
    # row 0's removal is folded into its re-use, as for any remove-then-add of a row
    assert update is not None and sorted(update.removed) == [1, 2]
    assert [a.req_id for a in update.added] == ["r9"]
