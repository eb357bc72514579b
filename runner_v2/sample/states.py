"""SamplingStates: per-state-row sampling parameters and penalty state on the device.

Rows are the RequestState's rows: permanent for a request's lifetime, reused LIFO and
never cleared on removal. So `add_request` overwrites EVERY per-row field; a stale
value left by an earlier request in the same row is only ever harmless when the new
request's own parameters make the sampler ignore it (penalty bins of a request without
penalties, the stop-id table of a request without min_tokens).

Writes are staged on the host and published by `apply_staged_writes()` with ONE
host-to-device copy of a packed int64 buffer, then one scatter kernel (and, when a
new request uses penalties, one bin-count kernel). Kernels read every field through
idx_mapping (batch row -> state row); nothing is expanded per batch row.

Penalty state exists only once some request used penalties (allocated lazily, or
eagerly with `ensure_penalty_state()`, e.g. before CUDA-graph capture):
  prompt_bin_mask   int32 [R, ceil(V / 32)]: bit (t % 32) of word t // 32 is set iff
                    token t occurs in the user prompt.
  output_bin_counts int32 [R, V], contiguous (row stride V): count of token t among
                    the request's outputs. Set at add from the prefill tokens beyond
                    prompt_len (outputs generated before a preemption); the runner's
                    post_update kernel then adds 1 at [state_row, sampled_token] for
                    every sampled token (when the tensor is not None).
Both rows are rebuilt at add only for requests that use penalties.

The built-in logits processors keep their own lazily allocated tables, filled by the
same add and shipped in the same copy: `logit_bias` (LogitBiasState: allowed_token_ids
and logit_bias, runner_v2/sample/logit_bias.py) and `bad_words` (BadWordsState,
runner_v2/sample/bad_words.py).
"""

from __future__ import annotations

import numpy as np
import torch

from runner_v2.sample.bad_words import BadWordsState
from runner_v2.sample.batch_flags import BatchFlags, flags_of_rows, row_flag_bits
from runner_v2.sample.logit_bias import LogitBiasState
from runner_v2.uva import async_copy_to_device
from shared.contract.sampling_params import SamplingParams
from shared.runtime.triton_launch import kept
from shared.runtime.triton_utils import tl, triton

# Column layout of one staged record (int64 words; floats as float64 bit patterns).
C_ROW = tl.constexpr(0)
C_TEMPERATURE = tl.constexpr(1)
C_TOP_K = tl.constexpr(2)
C_TOP_P = tl.constexpr(3)
C_MIN_P = tl.constexpr(4)
C_SEED = tl.constexpr(5)
C_REPETITION = tl.constexpr(6)
C_FREQUENCY = tl.constexpr(7)
C_PRESENCE = tl.constexpr(8)
C_MIN_TOKENS = tl.constexpr(9)
C_PROMPT_LEN = tl.constexpr(10)
C_NUM_STOP = tl.constexpr(11)
NUM_COLUMNS = tl.constexpr(12)  # the stop-id table follows
# add_request fills a record's integer and float columns with one assignment each
_INT_COLUMNS = [c.value for c in (C_ROW, C_TOP_K, C_SEED, C_MIN_TOKENS, C_PROMPT_LEN, C_NUM_STOP)]
_FLOAT_COLUMNS = [c.value for c in (C_TEMPERATURE, C_TOP_P, C_MIN_P, C_REPETITION, C_FREQUENCY,
                                    C_PRESENCE)]

# vLLM caps the ids masked for min_tokens at 128 as well.
DEFAULT_MAX_STOP_IDS = 128


class SamplingStates:
    def __init__(
        self,
        max_num_reqs: int,
        vocab_size: int,
        device: torch.device | str,
        max_stop_ids: int = DEFAULT_MAX_STOP_IDS,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_stop_ids = max_stop_ids
        r = max_num_reqs

        def dev(dtype, fill, shape=(r,)):
            return torch.full(shape, fill, dtype=dtype, device=self.device)

        self.temperature = dev(torch.float32, 1.0)
        self.top_k = dev(torch.int32, 0)  # 0 = off (also for top_k >= vocab_size)
        self.top_p = dev(torch.float32, 1.0)
        self.min_p = dev(torch.float32, 0.0)
        self.seeds = dev(torch.int64, 0)
        self.repetition_penalty = dev(torch.float32, 1.0)
        self.frequency_penalty = dev(torch.float32, 0.0)
        self.presence_penalty = dev(torch.float32, 0.0)
        self.min_tokens = dev(torch.int32, 0)
        self.prompt_len = dev(torch.int32, 0)
        self.num_stop_ids = dev(torch.int32, 0)
        self.stop_ids = dev(torch.int32, -1, (r, max_stop_ids))  # padded with -1
        self.prompt_bin_mask: torch.Tensor | None = None
        self.output_bin_counts: torch.Tensor | None = None
        # built-in logits processors: per-row tables, allocated on first use
        self.logit_bias = LogitBiasState(r, vocab_size, self.device)
        self.bad_words = BadWordsState(r, vocab_size, self.device)

        # Host side: decide which stages run without reading device values. Each row's
        # optional stages as bits (runner_v2/sample/batch_flags.py), set when the row is
        # written, and its logprob count.
        self.flag_bits_np = np.zeros(r, np.uint8)
        self.num_logprobs = np.full(r, -1, np.int32)  # host only; -1 = none
        self.written_np = np.zeros(r, bool)  # rows ever written (conservative flags)
        # batch_flags of the last batch, by its idx_mapping bytes: a steady decode asks for
        # the same batch every step, and the flags change only when a row is (re)written
        self._flags_key: bytes | None = None
        self._flags: BatchFlags | None = None

        self._staged: dict[int, np.ndarray] = {}  # row -> record
        self._staged_bins: dict[int, tuple[int, list[int]]] = {}  # row -> (prompt_len, tokens)
        self._rng = np.random.default_rng()
        self._seed_pool: list[int] = []  # unseeded requests' seeds, drawn in blocks

    # ---- add ---------------------------------------------------------------------

    def add_request(
        self,
        row: int,
        sampling_params: SamplingParams,
        prompt_token_ids: list[int],
        prefill_token_ids: list[int],
        eos_token_id: int | None,
    ) -> None:
        """Stage every per-row field of `row` for a new (or resumed) request: the
        single entry point for the sampler's per-row state, built-ins included."""
        sp = sampling_params
        stop = self._min_tokens_stop_ids(sp, eos_token_id)
        # every check before any staging: a refused request leaves the row as it was
        self.logit_bias.check(sp)
        self.bad_words.check(sp)
        seed = sp.seed if sp.seed is not None else self._random_seed()
        top_k = sp.top_k if 0 < sp.top_k < self.vocab_size else 0
        prompt_len = len(prompt_token_ids)

        rec = np.full(NUM_COLUMNS.value + self.max_stop_ids, -1, np.int64)  # ids pad: -1
        rec[_INT_COLUMNS] = (row, top_k, seed, sp.min_tokens, prompt_len, len(stop))
        # float32 values, exactly, as float64 bit patterns (one conversion for all six)
        rec[_FLOAT_COLUMNS] = np.array(
            (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty,
             sp.frequency_penalty, sp.presence_penalty), np.float32,
        ).astype(np.float64).view(np.int64)
        if stop:
            rec[NUM_COLUMNS.value : NUM_COLUMNS.value + len(stop)] = stop
        self._staged[row] = rec  # a row re-added before apply: the last request wins

        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.written_np[row] = True
        self._flags_key = None  # the row's flags changed

        self.logit_bias.add_request(row, sp)
        self.bad_words.add_request(row, sp)
        self.flag_bits_np[row] = row_flag_bits(
            sp, top_k, self.logit_bias.num_allowed_np[row], self.logit_bias.num_bias_np[row],
            self.bad_words.num_words_np[row])

        self._staged_bins.pop(row, None)
        if sp.uses_penalties:
            self.ensure_penalty_state()
            tokens = list(prompt_token_ids) + list(prefill_token_ids[prompt_len:])
            self._staged_bins[row] = (prompt_len, tokens)

    def _random_seed(self) -> int:
        """A seed for a request without one. Drawn a block at a time: one draw per
        request would cost a generator call on every admission."""
        if not self._seed_pool:
            self._seed_pool = self._rng.integers(0, 2**63, size=256).tolist()
        return self._seed_pool.pop()

    def _min_tokens_stop_ids(self, sp: SamplingParams, eos_token_id: int | None) -> list[int]:
        if sp.min_tokens == 0:
            return []  # the table is never read for this row
        stop = list(dict.fromkeys(sp.stop_token_ids))
        if eos_token_id is not None and not sp.ignore_eos and eos_token_id not in stop:
            stop.append(eos_token_id)
        if len(stop) > self.max_stop_ids:
            raise ValueError(
                f"min_tokens={sp.min_tokens} needs {len(stop)} stop token ids masked; "
                f"the V2 sampler supports at most {self.max_stop_ids}."
            )
        return stop

    def ensure_penalty_state(self) -> None:
        if self.output_bin_counts is not None:
            return
        r, v = self.max_num_reqs, self.vocab_size
        self.prompt_bin_mask = torch.zeros(r, (v + 31) // 32, dtype=torch.int32, device=self.device)
        self.output_bin_counts = torch.zeros(r, v, dtype=torch.int32, device=self.device)

    def ensure_logit_bias_state(self) -> None:
        """Allocate the allowed_token_ids / logit_bias tables now (else at first use)."""
        self.logit_bias.ensure_allocated()

    def ensure_bad_words_state(self) -> None:
        """Allocate the bad-words tables now (else at first use)."""
        self.bad_words.ensure_allocated()

    # ---- apply -------------------------------------------------------------------

    def discard_staged_writes(self) -> None:
        """Drop the rows staged but not shipped (the engine's recovery after a failed
        step); their next add stages them anew."""
        self._staged.clear()
        self._staged_bins.clear()
        self.logit_bias.discard_staged_writes()
        self.bad_words.discard_staged_writes()

    def apply_staged_writes(self) -> None:
        """Publish the staged rows: one H2D copy, one scatter, at most one bincount,
        and one table write per built-in with staged rows."""
        if not self._staged:
            return  # every add stages a record: the built-ins have nothing staged either
        records = np.stack(list(self._staged.values()))
        bin_rows = list(self._staged_bins)
        bins = [self._staged_bins[r] for r in bin_rows]
        starts = np.cumsum([0] + [len(t) for _, t in bins])
        tokens = [t for _, toks in bins for t in toks]
        m = len(bins)
        bias_seg, bias_rows = self.logit_bias.pack_staged()
        words_seg, words_rows = self.bad_words.pack_staged()
        packed = np.concatenate([
            records.reshape(-1),
            np.asarray(bin_rows, np.int64),
            np.asarray([p for p, _ in bins], np.int64),
            starts.astype(np.int64),
            np.asarray(tokens, np.int64),
            bias_seg,
            words_seg,
        ])
        self._staged.clear()
        self._staged_bins.clear()
        # Through a fresh pinned temporary: a copy from pageable memory may make the driver
        # synchronise with the stream to stage it, which under async scheduling would wait
        # for the step in flight (V2 bans implicit syncs).
        dev = async_copy_to_device(packed, self.device)
        n, width = records.shape
        write_rows(self, dev[: n * width].view(n, width))
        off = n * width
        bins_end = off + 3 * m + 1 + len(tokens)
        if m:
            rows = dev[off : off + m]
            prompt_lens = dev[off + m : off + 2 * m]
            starts_d = dev[off + 2 * m : off + 3 * m + 1]
            tokens_d = dev[off + 3 * m + 1 : bins_end]
            bincount_rows(self, rows, prompt_lens, starts_d, tokens_d)
        words_at = bins_end + len(bias_seg)
        self.logit_bias.write_packed(dev[bins_end:words_at], bias_rows)
        self.bad_words.write_packed(dev[words_at:], words_rows)

    # ---- flags -------------------------------------------------------------------

    def batch_flags(self, idx_mapping_np: np.ndarray | None = None) -> BatchFlags:
        """Which stages the batch needs, and its rows' logprob counts. Without the host
        idx_mapping, every row ever written counts: stale rows may switch a stage on
        needlessly, never wrongly, because each kernel still reads its own rows'
        parameters (and there are no per-row logprob counts)."""
        key = None if idx_mapping_np is None else idx_mapping_np.tobytes()
        if key is not None and key == self._flags_key:
            return self._flags
        if idx_mapping_np is None:
            flags = flags_of_rows(self.flag_bits_np, self.num_logprobs,
                                  np.flatnonzero(self.written_np), per_row=False)
        else:
            flags = flags_of_rows(self.flag_bits_np, self.num_logprobs, idx_mapping_np)
        if key is not None:
            self._flags_key, self._flags = key, flags
        return flags


@triton.jit
def as_f32(word):
    """A float32 value staged as its float64 bit pattern (exact both ways)."""
    return word.to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def _write_rows_kernel(
    rec_ptr,  # int64 [n, WIDTH], one staged record per program
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,  # [R]
    seeds_ptr,  # int64 [R]
    repetition_ptr, frequency_ptr, presence_ptr,  # float32 [R]
    min_tokens_ptr, prompt_len_ptr, num_stop_ptr,  # int32 [R]
    stop_ids_ptr,  # int32 [R, MAX_STOP]
    WIDTH: tl.constexpr, MAX_STOP: tl.constexpr, BLOCK: tl.constexpr,
):
    rec = rec_ptr + tl.program_id(0) * WIDTH
    row = tl.load(rec + C_ROW)
    tl.store(temperature_ptr + row, as_f32(tl.load(rec + C_TEMPERATURE)))
    tl.store(top_k_ptr + row, tl.load(rec + C_TOP_K).to(tl.int32))
    tl.store(top_p_ptr + row, as_f32(tl.load(rec + C_TOP_P)))
    tl.store(min_p_ptr + row, as_f32(tl.load(rec + C_MIN_P)))
    tl.store(seeds_ptr + row, tl.load(rec + C_SEED))
    tl.store(repetition_ptr + row, as_f32(tl.load(rec + C_REPETITION)))
    tl.store(frequency_ptr + row, as_f32(tl.load(rec + C_FREQUENCY)))
    tl.store(presence_ptr + row, as_f32(tl.load(rec + C_PRESENCE)))
    tl.store(min_tokens_ptr + row, tl.load(rec + C_MIN_TOKENS).to(tl.int32))
    tl.store(prompt_len_ptr + row, tl.load(rec + C_PROMPT_LEN).to(tl.int32))
    tl.store(num_stop_ptr + row, tl.load(rec + C_NUM_STOP).to(tl.int32))
    offs = tl.arange(0, BLOCK)
    ids = tl.load(rec + NUM_COLUMNS + offs, mask=offs < MAX_STOP)
    tl.store(stop_ids_ptr + row * MAX_STOP + offs, ids.to(tl.int32), mask=offs < MAX_STOP)


def write_rows(states: SamplingStates, records: torch.Tensor) -> None:
    """Scatter staged records (int64 [n, WIDTH], already on the device) into the rows."""
    n, width = records.shape
    assert width == NUM_COLUMNS.value + states.max_stop_ids and records.dtype == torch.int64
    kept(_write_rows_kernel)((n,),
        records, states.temperature, states.top_k, states.top_p, states.min_p, states.seeds,
        states.repetition_penalty, states.frequency_penalty, states.presence_penalty,
        states.min_tokens, states.prompt_len, states.num_stop_ids, states.stop_ids,
        WIDTH=width, MAX_STOP=states.max_stop_ids,
        BLOCK=triton.next_power_of_2(states.max_stop_ids),
    )


@triton.jit
def _bincount_kernel(
    tokens_ptr,  # int64 [T]: per penalty row, its prompt then its resumed outputs
    starts_ptr,  # int64 [m + 1]: offsets into tokens
    rows_ptr,  # int64 [m]: state rows
    prompt_lens_ptr,  # int64 [m]
    prompt_mask_ptr,  # int32 [R, num_words] bitset
    counts_ptr,  # int32 [R, vocab_size]
    vocab_size, num_words,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    start = tl.load(starts_ptr + i)
    end = tl.load(starts_ptr + i + 1)
    prompt_end = start + tl.load(prompt_lens_ptr + i)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        valid = offs < end
        tok = tl.load(tokens_ptr + offs, mask=valid, other=0)
        valid = valid & (tok >= 0) & (tok < vocab_size)
        is_prompt = offs < prompt_end
        # atomics: a token may repeat within one block
        bit = (tl.full([BLOCK], 1, tl.int64) << (tok % 32)).to(tl.int32)
        tl.atomic_or(prompt_mask_ptr + row * num_words + tok // 32, bit, mask=valid & is_prompt)
        tl.atomic_add(counts_ptr + row * vocab_size + tok, 1, mask=valid & ~is_prompt)


def bincount_rows(
    states: SamplingStates,
    rows: torch.Tensor,
    prompt_lens: torch.Tensor,
    starts: torch.Tensor,
    tokens: torch.Tensor,
) -> None:
    """Rebuild the penalty rows `rows` (int64 [m], device) from their tokens."""
    mask, counts = states.prompt_bin_mask, states.output_bin_counts
    assert mask is not None and counts is not None
    assert rows.dtype == prompt_lens.dtype == starts.dtype == tokens.dtype == torch.int64
    assert starts.shape == (rows.shape[0] + 1,) and prompt_lens.shape == rows.shape
    # From zero: whatever an earlier request of the same row left there is stale.
    mask.index_fill_(0, rows, 0)
    counts.index_fill_(0, rows, 0)
    kept(_bincount_kernel)((rows.shape[0],),
        tokens, starts, rows, prompt_lens, mask, counts, states.vocab_size, mask.shape[1],
        BLOCK=1024,
    )
