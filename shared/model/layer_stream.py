"""One persistent kernel for a decoder stack's batch-1 GEMVs: the experiment that asks
whether fewer grid completions per layer close the decode step's gap to the HBM floor.

Under the per-kernel path (shared/model/gemv.py) each of a layer's GEMVs is its own grid,
launched with PDL: between two of them the SMs drain, the next grid's programs wait for the
whole previous grid to complete and flush (griddepcontrol.wait), and only one weight tile
per program is in flight across that wait. Here P programs, all resident at once, walk
the whole stack: for each layer qkv -> o_proj (+ residual) -> gate_up (+ SiLU) -> down
(+ residual), every program owning the same number of row tiles in every phase. Between
two phases a program
  1. counts itself done on the phase's counter (CTA barrier, then one release atomic),
  2. loads its first weight tile of the next phase (weights never depend on the phase
     before),
  3. spins on the counter until all P programs are done (acquire), then reads the phase's
     output.
So the next matrix's first tiles stream in while the last programs of a phase finish,
with no kernel boundary at all.

What it does not do (a diagnostic, like bench_decode's `noattn` row): no attention, no
RoPE, no KV cache; o_proj takes q (the first H outputs of qkv) as the attention output.
Its result is a measured per-layer time against the same chain of gemv() kernels
(scripts/bench_layer_stream.py), not a model path.

Hazards, each handled where it arises:
- Every program must be resident, or a spin waits for a program that cannot start:
  `check_residency` compares P with what the SMs hold for the compiled kernel; the spin is
  also bounded (MAX_SPIN), after which the program raises the error flag and goes on
  (wrong results, never a hung GPU).
- The activations are written by other SMs inside this kernel, and L1 is not coherent:
  every activation load is `.cg` (L2 only).
- Counters are one per (layer, phase), zeroed before each launch (`zero_counters`), so no
  phase can see a count left from another.
- Each phase writes its own buffer (h has 2L + 1 rows), so no program overwrites a vector
  that a slower program of the phase before still reads.
"""

from __future__ import annotations

import torch

from shared.model.gemv_tiles import fma_row_sums
from shared.triton_utils import tl, triton

# Spins before a program gives up on a counter and raises the error flag: a phase takes
# at most ~60 us on the H200 (~100 spins of one L2 round trip); 2^18 spins are ~0.2 s, so
# a launch that cannot finish (128 waits) gives up in seconds instead of hanging.
MAX_SPIN = 1 << 18
PHASES = 4  # qkv, o_proj, gate_up, down


@triton.jit
def _arrive(count_ptr, SYNC: tl.constexpr):
    """This program's stores of the phase are done: count it (after a CTA barrier, so the
    release covers every thread's stores)."""
    if SYNC:
        tl.debug_barrier()
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(count_ptr, target, error_ptr, MAX_SPIN: tl.constexpr, SYNC: tl.constexpr):
    """Spin until `target` programs have arrived on the counter (acquire)."""
    if SYNC:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < target) & (spins < MAX_SPIN):
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        if seen < target:
            tl.atomic_add(error_ptr, 1)
        tl.debug_barrier()


@triton.jit
def _tile_at(w_ptr, N_OUT, pid, step, K: tl.constexpr, TILES: tl.constexpr,
             P: tl.constexpr, PAIRED: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """The weight tile of the program's `step` in a phase: row tile pid + (step // KT) * P,
    K chunk step % KT. Steps past the phase's last load nothing (masked)."""
    KT: tl.constexpr = K // BLOCK_K
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (pid + (step // KT) * P) * BLOCK_N + offs_n
    # a tensor comparison: `step` may be a plain int (under the interpreter) or a tensor
    live = (offs_n * 0 + step) < TILES * KT
    mask = live[:, None] & (offs_k < BLOCK_K)[None, :]
    # int32 offsets: the pointer is one layer's matrix, at most 2 x 14336 x 4096 elements
    first = rows[:, None] * K + (step % KT) * BLOCK_K + offs_k[None, :]
    wa = tl.load(w_ptr + first, mask=mask, other=0.0, eviction_policy="evict_first")
    wb = wa
    if PAIRED:
        wb = tl.load(w_ptr + N_OUT * K + first, mask=mask, other=0.0,
                     eviction_policy="evict_first")
    return wa, wb


@triton.jit
def _first_tiles(w_ptr, N_OUT, pid, K: tl.constexpr, TILES: tl.constexpr, P: tl.constexpr,
                 PAIRED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 AHEAD: tl.constexpr):
    """A phase's first AHEAD tiles of the program (AHEAD 1: the later two are the first)."""
    a0, b0 = _tile_at(w_ptr, N_OUT, pid, 0, K, TILES, P, PAIRED, BLOCK_N, BLOCK_K)
    a1, b1, a2, b2 = a0, b0, a0, b0
    if AHEAD == 3:
        a1, b1 = _tile_at(w_ptr, N_OUT, pid, 1, K, TILES, P, PAIRED, BLOCK_N, BLOCK_K)
        a2, b2 = _tile_at(w_ptr, N_OUT, pid, 2, K, TILES, P, PAIRED, BLOCK_N, BLOCK_K)
    return a0, b0, a1, b1, a2, b2


@triton.jit
def _step(acc, wa, wb, kt, w_ptr, load_step, x_ptr, norm_ptr, N_OUT, pid, K: tl.constexpr,
          TILES: tl.constexpr, P: tl.constexpr, HAS_NORM: tl.constexpr,
          PAIRED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One step of a phase: load the tile of `load_step`, then acc += (wa, wb) * x chunk
    kt (times the norm weight; sum x^2 accumulates). Returns the new tile and acc."""
    na, nb = _tile_at(w_ptr, N_OUT, pid, load_step, K, TILES, P, PAIRED, BLOCK_N, BLOCK_K)
    acc_a, acc_b, sum_sq = acc
    cols = kt * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + cols, cache_modifier=".cg").to(tl.float32)
    if HAS_NORM:
        sum_sq += x * x
        x = x * tl.load(norm_ptr + cols).to(tl.float32)
    acc_a += wa.to(tl.float32) * x[None, :]
    if PAIRED:
        acc_b += wb.to(tl.float32) * x[None, :]
    return na, nb, (acc_a, acc_b, sum_sq)


@triton.jit
def _phase(x_ptr, w_ptr, norm_ptr, res_ptr, out_ptr, tiles, pid, eps, N_OUT,
           K: tl.constexpr, TILES: tl.constexpr, P: tl.constexpr, HAS_NORM: tl.constexpr,
           EPILOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           AHEAD: tl.constexpr):
    """The program's TILES row tiles (pid, pid + P, ...) of out = epilogue(W @ norm?(x)),
    each over the whole of K, with its first AHEAD steps' weight tiles already loaded
    (`tiles`, from _first_tiles). Each step loads the tile AHEAD steps on (across row
    tiles) before it multiplies its own: AHEAD + 1 tiles in flight per program.

    The K loop is unrolled AHEAD + 1 times so that every tile keeps its register slot:
    rotating slots (a0, a1 = a1, a_next) would be register moves, and a move out of a
    register whose load is still in flight waits for it (the first form did this: its
    streaming alone, without counters, ran at 135-155 us per llama layer against 116 for
    the per-kernel chain). EPILOGUE 0 none, 1 residual, 2 SiLU (rows j and j + N_OUT)."""
    PAIRED: tl.constexpr = EPILOGUE == 2
    KT: tl.constexpr = K // BLOCK_K
    a0, b0, a1, b1, a2, b2 = tiles
    for j in range(TILES):
        rows = (pid + j * P) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for kq in range(0, KT, AHEAD + 1):
            s = j * KT + kq
            acc = acc_a, acc_b, sum_sq
            if AHEAD == 3:
                a3, b3, acc = _step(acc, a0, b0, kq, w_ptr, s + 3, x_ptr, norm_ptr,
                                    N_OUT, pid, K, TILES, P, HAS_NORM, PAIRED,
                                    BLOCK_N, BLOCK_K)
                a0, b0, acc = _step(acc, a1, b1, kq + 1, w_ptr, s + 4, x_ptr, norm_ptr,
                                    N_OUT, pid, K, TILES, P, HAS_NORM, PAIRED,
                                    BLOCK_N, BLOCK_K)
                a1, b1, acc = _step(acc, a2, b2, kq + 2, w_ptr, s + 5, x_ptr, norm_ptr,
                                    N_OUT, pid, K, TILES, P, HAS_NORM, PAIRED,
                                    BLOCK_N, BLOCK_K)
                a2, b2, acc = _step(acc, a3, b3, kq + 3, w_ptr, s + 6, x_ptr, norm_ptr,
                                    N_OUT, pid, K, TILES, P, HAS_NORM, PAIRED,
                                    BLOCK_N, BLOCK_K)
            else:
                a1, b1, acc = _step(acc, a0, b0, kq, w_ptr, s + 1, x_ptr, norm_ptr,
                                    N_OUT, pid, K, TILES, P, HAS_NORM, PAIRED,
                                    BLOCK_N, BLOCK_K)
                a0, b0, acc = _step(acc, a1, b1, kq + 1, w_ptr, s + 2, x_ptr, norm_ptr,
                                    N_OUT, pid, K, TILES, P, HAS_NORM, PAIRED,
                                    BLOCK_N, BLOCK_K)
            acc_a, acc_b, sum_sq = acc
        _store_rows(acc_a, acc_b, sum_sq, rows, res_ptr, out_ptr, eps, K, HAS_NORM, EPILOGUE)


@triton.jit
def _store_rows(acc_a, acc_b, sum_sq, rows, res_ptr, out_ptr, eps, K: tl.constexpr,
                HAS_NORM: tl.constexpr, EPILOGUE: tl.constexpr):
    """A row tile's outputs, rounded where gemv.apply_epilogue rounds."""
    dtype = out_ptr.dtype.element_ty
    y_a, y_b = fma_row_sums(acc_a, acc_b, sum_sq, eps, K, HAS_NORM)
    y_a = y_a.to(dtype).to(tl.float32)
    if EPILOGUE == 1:
        r = tl.load(res_ptr + rows, cache_modifier=".cg").to(tl.float32)
        y_a = y_a + r
    elif EPILOGUE == 2:
        act = (y_a / (1.0 + tl.exp(-y_a))).to(dtype).to(tl.float32)
        y_a = act * y_b.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows, y_a.to(dtype))


@triton.jit
def _layer_stream_kernel(
    h_ptr,  # [2L + 1, H]: h[0] the input; layer l writes h[2l + 1] (o_proj) and h[2l + 2]
    qkv_ptr,  # [L, QKV]
    g_ptr,  # [L, INTER]: silu(gate) * up
    w_qkv, w_o, w_gu, w_d,  # [L, QKV, H], [L, H, H], [L, 2 INTER, H], [L, H, INTER]
    norm1_ptr, norm2_ptr,  # [L, H]
    count_ptr,  # int32 [L, PHASES], zero at launch
    error_ptr,  # int32 [1]: programs that gave up waiting
    eps,
    L: tl.constexpr, H: tl.constexpr, QKV: tl.constexpr, INTER: tl.constexpr,
    P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MAX_SPIN: tl.constexpr,
    AHEAD: tl.constexpr = 1,  # weight tiles a program loads ahead of the one it multiplies
    SYNC: tl.constexpr = True,  # False: no counters (a diagnostic: wrong results)
):
    pid = tl.program_id(0)
    T_QKV: tl.constexpr = QKV // BLOCK_N // P
    T_H: tl.constexpr = H // BLOCK_N // P
    T_I: tl.constexpr = INTER // BLOCK_N // P
    tiles = _first_tiles(w_qkv, 0, pid, H, T_QKV, P, False, BLOCK_N, BLOCK_K, AHEAD)
    # The weight pointers advance a layer at a time: layer x (2 INTER x H) overflows int32.
    for layer in range(L):
        count = count_ptr + layer * 4  # PHASES counters per layer
        h_in = h_ptr + (2 * layer) * H
        h_mid = h_in + H
        qkv = qkv_ptr + layer * QKV
        g = g_ptr + layer * INTER
        _phase(h_in, w_qkv, norm1_ptr + layer * H, h_in, qkv, tiles, pid, eps, QKV,
               H, T_QKV, P, True, 0, BLOCK_N, BLOCK_K, AHEAD)
        _arrive(count, SYNC)
        tiles = _first_tiles(w_o, 0, pid, H, T_H, P, False, BLOCK_N, BLOCK_K, AHEAD)
        _wait(count, P, error_ptr, MAX_SPIN, SYNC)
        _phase(qkv, w_o, norm1_ptr, h_in, h_mid, tiles, pid, eps, H,
               H, T_H, P, False, 1, BLOCK_N, BLOCK_K, AHEAD)
        _arrive(count + 1, SYNC)
        tiles = _first_tiles(w_gu, INTER, pid, H, T_I, P, True, BLOCK_N, BLOCK_K, AHEAD)
        _wait(count + 1, P, error_ptr, MAX_SPIN, SYNC)
        _phase(h_mid, w_gu, norm2_ptr + layer * H, h_mid, g, tiles, pid, eps, INTER,
               H, T_I, P, True, 2, BLOCK_N, BLOCK_K, AHEAD)
        _arrive(count + 2, SYNC)
        tiles = _first_tiles(w_d, 0, pid, INTER, T_H, P, False, BLOCK_N, BLOCK_K, AHEAD)
        _wait(count + 2, P, error_ptr, MAX_SPIN, SYNC)
        _phase(g, w_d, norm2_ptr, h_mid, h_mid + H, tiles, pid, eps, H,
               INTER, T_H, P, False, 1, BLOCK_N, BLOCK_K, AHEAD)
        _arrive(count + 3, SYNC)
        w_qkv += QKV * H
        w_o += H * H
        w_gu += 2 * INTER * H
        w_d += H * INTER
        if layer + 1 < L:
            tiles = _first_tiles(w_qkv, 0, pid, H, T_QKV, P, False, BLOCK_N, BLOCK_K, AHEAD)
        _wait(count + 3, P, error_ptr, MAX_SPIN, SYNC)


class LayerStack:
    """A decoder stack's stacked weights (dummy or copied), its activation buffers and the
    launch of the persistent kernel over them."""

    def __init__(self, w_qkv: torch.Tensor, w_o: torch.Tensor, w_gu: torch.Tensor,
                 w_d: torch.Tensor, norm1: torch.Tensor, norm2: torch.Tensor, eps: float):
        self.layers, self.qkv_size, self.hidden = w_qkv.shape
        self.inter = w_d.shape[2]
        assert w_o.shape == (self.layers, self.hidden, self.hidden), w_o.shape
        assert w_gu.shape == (self.layers, 2 * self.inter, self.hidden), w_gu.shape
        assert w_d.shape == (self.layers, self.hidden, self.inter), w_d.shape
        assert self.qkv_size >= self.hidden, "o_proj takes q, the first H of qkv"
        self.w_qkv, self.w_o, self.w_gu, self.w_d = w_qkv, w_o, w_gu, w_d
        self.norm1, self.norm2, self.eps = norm1, norm2, eps
        dev, dt = w_qkv.device, w_qkv.dtype
        self.h = torch.zeros(2 * self.layers + 1, self.hidden, dtype=dt, device=dev)
        self.qkv = torch.zeros(self.layers, self.qkv_size, dtype=dt, device=dev)
        self.g = torch.zeros(self.layers, self.inter, dtype=dt, device=dev)
        self.count = torch.zeros(self.layers, PHASES, dtype=torch.int32, device=dev)
        self.error = torch.zeros(1, dtype=torch.int32, device=dev)
        self._resident: set[tuple] = set()  # configs checked to fit

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size()
                   for w in (self.w_qkv, self.w_o, self.w_gu, self.w_d))

    def check_shape(self, programs: int, block_n: int, block_k: int) -> None:
        """Every phase must give each program the same whole number of row tiles, and K
        must be whole BLOCK_K chunks (the kernel has no masks for either)."""
        for name, rows in (("qkv", self.qkv_size), ("hidden", self.hidden),
                           ("intermediate", self.inter)):
            if rows % (block_n * programs):
                raise ValueError(f"{name} size {rows} is not a multiple of BLOCK_N x programs"
                                 f" = {block_n} x {programs}: pick programs that divide it")
        for k in (self.hidden, self.inter):
            if k % block_k:
                raise ValueError(f"K = {k} is not a multiple of BLOCK_K = {block_k}")

    @staticmethod
    def check_unroll(k_chunks: tuple[int, ...], ahead: int) -> None:
        """The K loop is unrolled ahead + 1 times (see _phase)."""
        if ahead not in (1, 3):
            raise ValueError(f"ahead = {ahead}: the kernel holds 1 or 3 tiles ahead")
        for kt in k_chunks:
            if kt % (ahead + 1):
                raise ValueError(f"{kt} K chunks do not split into ahead + 1 = {ahead + 1}"
                                 " unrolled steps: pick another BLOCK_K or ahead")

    def run(self, programs: int, block_n: int = 8, block_k: int = 256, num_warps: int = 4,
            ahead: int = 1, sync: bool = True) -> torch.Tensor:
        """h[0] must hold the input row; returns the stack's output row h[2L] (a view).
        `ahead`: weight tiles in flight beyond the one being multiplied (1 or 3);
        sync=False drops the counters (a diagnostic of the streaming alone)."""
        self.check_shape(programs, block_n, block_k)
        self.check_unroll((self.hidden // block_k, self.inter // block_k), ahead)
        self.count.zero_()  # a memset node under graphs: no count survives a launch
        args = (self.h, self.qkv, self.g, self.w_qkv, self.w_o, self.w_gu, self.w_d,
                self.norm1, self.norm2, self.count, self.error, self.eps)
        meta = dict(L=self.layers, H=self.hidden, QKV=self.qkv_size, INTER=self.inter,
                    P=programs, BLOCK_N=block_n, BLOCK_K=block_k, MAX_SPIN=MAX_SPIN,
                    AHEAD=ahead, SYNC=sync)
        if self.h.is_cuda:
            meta["num_warps"] = num_warps
            meta["num_stages"] = 1
            key = (programs, block_n, block_k, num_warps, ahead, sync)
            if key not in self._resident:
                compiled = _layer_stream_kernel.warmup(*args, grid=(programs,), **meta)
                check_residency(compiled, programs, num_warps, self.h.device)
                self._resident.add(key)
        _layer_stream_kernel[(programs,)](*args, **meta)
        return self.h[2 * self.layers]


def check_residency(compiled, programs: int, num_warps: int, device: torch.device) -> None:
    """Raise unless all `programs` fit on the device at once: a program that cannot start
    would leave the others spinning until MAX_SPIN."""
    compiled._init_handles()  # loads the module: n_regs is known from then on
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    regs = max(1, compiled.n_regs) * threads
    smem = max(1, compiled.metadata.shared)
    # 64K registers per SM on every sm_70+ GPU; older torch does not report it
    per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // regs,
                 props.shared_memory_per_multiprocessor // smem,
                 props.max_threads_per_multi_processor // threads, 32)
    if programs > per_sm * props.multi_processor_count:
        raise ValueError(f"{programs} programs do not fit at once ({per_sm} per SM x "
                         f"{props.multi_processor_count} SMs at {compiled.n_regs} registers"
                         f" per thread): lower `programs` or num_warps")

