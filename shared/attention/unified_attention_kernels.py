"""Triton kernels of the unified paged attention: one kernel for any mix of prefills,
chunked prefills and decodes, plus the reduction of its KV splits. The host side (launch
configuration and the `paged_attention` launcher) is in triton_unified_attention.

Layout: query/output [T, H, D] (T = padded tokens), key/value cache
[num_blocks, block_size, Hkv, D], block_table int32 [R, max_blocks] (R = padded rows),
seq_lens int32 [R], query_start_loc int32 [R + 1].

A program owns one KV head and a tile of query rows; the rows of a tile are
(query token, head of the GQA group) pairs, so every K/V tile it loads from the cache
serves all GROUP query heads at once: each KV block is read once per program, not once
per query head. Query j of a request with seq_len S and query length q sits at absolute
position S - q + j and sees keys 0..S-q+j (this offset is what makes chunked prefill and
prefix-cache hits correct). Softmax is online, in fp32 (fp64 for fp64 inputs), in the
log2 domain.

The same kernel runs in two program mappings (compile-time SINGLE_QUERY):
- split-KV rows of exactly BLOCK_Q query tokens: program = (request, kv head, split).
  BLOCK_Q is 1 for decodes, and 1 + k for the rows of a uniform speculative verify (every
  row the same short length), whose few tokens fit one program's tile as a decode's
  GROUP heads do. The context of a request is cut into NUM_SPLITS ranges so that batch
  1 x 32k still fills the GPU; each split writes an unnormalised partial per (query
  token, head) and `reduce_splits_kernel` merges them. (The name: the mapping began with
  decodes alone.)
- multi-query rows (prefill chunks): program = (query tile, kv head). Tile t belongs to
  the request r with first_tile(r) <= t < first_tile(r + 1), where
  first_tile(r) = query_start_loc[r] // BLOCK_Q + r; found by binary search. The sum of
  tiles over requests is at most T // BLOCK_Q + R, so that is the (fixed) grid.

Padded rows (query length 0, seq_len 0) and padded tokens are never written.
"""

from __future__ import annotations

from shared.runtime.triton_utils import pdl_wait_and_release, tl, triton


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """The request r with first_tile(r) <= tile < first_tile(r + 1).

    first_tile is strictly increasing (query_start_loc never decreases, + r), and
    first_tile(0) = 0, so a binary search for the first r with first_tile(r) > tile
    lands one past the answer. Padded rows repeat the last query_start_loc, so tiles
    past the real ones map to padded rows (query length 0) and exit.
    """
    lo = tl.zeros((), dtype=tl.int32)
    hi = tl.zeros((), dtype=tl.int32) + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first <= tile
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def tiles_per_split(num_tiles, NUM_SPLITS: tl.constexpr, MIN_TILES_PER_SPLIT: tl.constexpr):
    """The split partition of a row's KV tiles, shared by every kernel that writes split
    partials and by reduce_splits_kernel, which counts the splits that wrote one:
    split s covers tiles [s * tiles_per_split, (s + 1) * tiles_per_split)."""
    return tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), MIN_TILES_PER_SPLIT)


@triton.jit
def split_tile_range(num_tiles, split, NUM_SPLITS: tl.constexpr,
                     MIN_TILES_PER_SPLIT: tl.constexpr):
    """Split `split`'s tiles [tile_lo, tile_hi); empty past the end of a short row."""
    tile_lo = split * tiles_per_split(num_tiles, NUM_SPLITS, MIN_TILES_PER_SPLIT)
    tile_hi = tl.minimum(tile_lo + tiles_per_split(num_tiles, NUM_SPLITS, MIN_TILES_PER_SPLIT),
                         num_tiles)
    return tile_lo, tile_hi


@triton.jit
def attend_kv_tiles(
    q,  # [BLOCK_M, BLOCK_D] query rows of one program
    q_abs,  # [BLOCK_M] absolute position of each row's query token
    acc, l_i, m_i,  # running output [BLOCK_M, BLOCK_D], denominator and max [BLOCK_M]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_row,  # this request's block-table row
    kv_head, tile_lo, tile_hi, kv_end, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over KV tiles [tile_lo, tile_hi) of one request and one KV head."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE_N + offs_n
        k_valid = k_pos < kv_end
        # k_pos < seq_len keeps the block-table read inside this request's row.
        blk = tl.load(block_row + k_pos // KV_BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        in_blk = k_pos % KV_BLOCK_SIZE
        kv_mask = k_valid[:, None] & d_valid[None, :]
        k = tl.load(
            key_cache_ptr + blk[:, None] * stride_kb + in_blk[:, None] * stride_ks
            + kv_head * stride_kh + offs_d[None, :] * stride_kd,
            mask=kv_mask, other=0.0,
        ).to(DOT_DTYPE)
        v = tl.load(
            value_cache_ptr + blk[:, None] * stride_vb + in_blk[:, None] * stride_vs
            + kv_head * stride_vh + offs_d[None, :] * stride_vd,
            mask=kv_mask, other=0.0,
        ).to(DOT_DTYPE)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (k_pos[None, :] <= q_abs[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key (padding rows of the tile) keeps m = -inf;
        # shifting it by 0 makes exp2(-inf - m) = 0 instead of NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # out_dtype spelled out: older Triton defaults it to fp32 even for an fp64 acc.
        acc = tl.dot(p.to(DOT_DTYPE), v, acc=acc, input_precision=DOT_PRECISION,
                     out_dtype=acc.dtype)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fold_partial(acc, l_i, m_i, acc_s, l_s, m_s):
    """Merge the partial (acc_s, l_s, m_s) of one KV split into the running (acc, l_i,
    m_i): rows [M] and outputs [M, D]. Batch-invariant mode folds a token's fixed-size
    splits with this, in split order, in every mapping (reduce_splits_kernel for split
    programs, the program itself otherwise), so the token's result has one reduction
    order wherever it runs. A split with no visible key (m_s -inf, l_s 0, acc_s 0) leaves
    the running values exactly as they were; the first fold into the empty state (m_i
    -inf) returns the split's partial exactly. The sums are explicit FMAs: left as x * a
    + y * b, the compiler may fuse either product into the add, and could choose
    differently in the two kernels that fold."""
    m_new = tl.maximum(m_i, m_s)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.math.exp2(m_i - m_shift)
    b = tl.math.exp2(m_s - m_shift)
    acc = tl.math.fma(acc, a[:, None], acc_s * b[:, None])
    return acc, tl.math.fma(l_i, a, l_s * b), m_new


@triton.jit
def attend_kv_splits(
    q, q_abs, acc, l_i, m_i, key_cache_ptr, value_cache_ptr, block_row,
    kv_head, tile_lo, tile_hi, kv_end, qk_scale,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FOLD_TILES: tl.constexpr,
):
    """attend_kv_tiles over [tile_lo, tile_hi), or (FOLD_TILES > 0) over each split of
    FOLD_TILES tiles from a fresh state, folded in order (fold_partial). tile_lo must
    then be a multiple of FOLD_TILES: the splits sit at fixed key positions."""
    if FOLD_TILES == 0:
        acc, l_i, m_i = attend_kv_tiles(
            q, q_abs, acc, l_i, m_i, key_cache_ptr, value_cache_ptr, block_row,
            kv_head, tile_lo, tile_hi, kv_end, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            BLOCK_D, HEAD_DIM, TILE_N, KV_BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION)
    else:
        for split_lo in range(tile_lo, tile_hi, FOLD_TILES):
            acc_s, l_s, m_s = attend_kv_tiles(
                q, q_abs, tl.zeros_like(acc), tl.zeros_like(l_i),
                tl.full(m_i.shape, float("-inf"), m_i.dtype),
                key_cache_ptr, value_cache_ptr, block_row, kv_head, split_lo,
                tl.minimum(split_lo + FOLD_TILES, tile_hi), kv_end, qk_scale,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                BLOCK_D, HEAD_DIM, TILE_N, KV_BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION)
            acc, l_i, m_i = fold_partial(acc, l_i, m_i, acc_s, l_s, m_s)
    return acc, l_i, m_i


# num_reqs changes with the padded batch size: not specialising on it (== 1, % 16) keeps
# the compiled variants few. (Runners still warm up each capture size before capturing:
# NUM_SPLITS, a constexpr, follows the padded row count.)
@triton.jit(do_not_specialize=["num_reqs"])
def paged_attention_kernel(
    output_ptr,  # [T, H, D]
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    value_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_table_ptr,  # int32 [R, max_blocks_per_req]
    seq_lens_ptr,  # int32 [R]
    query_start_loc_ptr,  # int32 [R + 1]
    part_out_ptr,  # fp32 [R * BLOCK_Q, H, NUM_SPLITS, D]: unnormalised split outputs
    part_max_ptr,  # fp32 [R * BLOCK_Q, H, NUM_SPLITS]: running max, log2 domain
    part_sum_ptr,  # fp32 [R * BLOCK_Q, H, NUM_SPLITS]: softmax denominators
    qk_scale,  # softmax scale * log2(e)
    num_reqs,  # R (padded)
    stride_ot, stride_oh, stride_od,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of 2
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,  # query tokens per program
    TILE_N: tl.constexpr,  # keys per loop iteration (may span several KV blocks)
    KV_BLOCK_SIZE: tl.constexpr,
    SINGLE_QUERY: tl.constexpr,
    MIN_QUERY_LEN: tl.constexpr,  # multi-query mapping: rows shorter than this are skipped
    NUM_SPLITS: tl.constexpr,
    MIN_TILES_PER_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (sm_90+)
    FOLD_TILES: tl.constexpr = 0,  # batch-invariant mode: the fixed split, in KV tiles
):
    if USE_PDL:  # launched while the KV-cache write before it drains
        pdl_wait_and_release()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    if SINGLE_QUERY:
        req = tile
        q_tile_start = 0
    else:
        req = _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q)
        first_tile = tl.load(query_start_loc_ptr + req) // BLOCK_Q + req
        q_tile_start = (tile - first_tile) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # Keys this program needs: up to the causal limit of its last query row.
    kv_end = tl.minimum(seq_len, context_len + q_tile_start + BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if NUM_SPLITS > 1:
        tile_lo, tile_hi = split_tile_range(num_tiles, split, NUM_SPLITS, MIN_TILES_PER_SPLIT)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    if SINGLE_QUERY:
        # Rows of another length belong to the other mapping; padded rows (q_len 0) exit
        # here.
        skip = q_len != BLOCK_Q
    else:
        skip = (q_len < MIN_QUERY_LEN) | (q_tile_start >= q_len)
    # Splits past the end of a short context have nothing to read (the reduce skips them).
    if skip | (tile_lo >= tile_hi):
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    q_pos = q_tile_start + q_idx  # position within this request's query
    row_valid = (q_idx < BLOCK_Q) & (q_pos < q_len)
    d_valid = offs_d < HEAD_DIM
    token = (q_start + q_pos).to(tl.int64)
    q_abs = context_len + q_pos  # absolute position of each row's query token

    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(
        query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=q_mask, other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if DOT_DTYPE == tl.float64:
        m_i = m_i.to(tl.float64)
        l_i = l_i.to(tl.float64)
        acc = acc.to(tl.float64)
    acc, l_i, m_i = attend_kv_splits(
        q, q_abs, acc, l_i, m_i, key_cache_ptr, value_cache_ptr,
        block_table_ptr + req.to(tl.int64) * stride_bt, kv_head, tile_lo, tile_hi, kv_end,
        qk_scale, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        BLOCK_D, HEAD_DIM, TILE_N, KV_BLOCK_SIZE, DOT_DTYPE, DOT_PRECISION, FOLD_TILES,
    )

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            output_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            out.to(output_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:
        # [BLOCK_M]: one partial per (query token of the row, head, split)
        part = ((req.to(tl.int64) * BLOCK_Q + q_pos) * num_heads + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)


@triton.jit
def reduce_splits_kernel(
    output_ptr,  # [T, H, D]
    part_out_ptr,  # fp32 [R * QUERY_LEN, H, NUM_SPLITS, D]
    part_max_ptr,  # fp32 [R * QUERY_LEN, H, NUM_SPLITS]
    part_sum_ptr,  # fp32 [R * QUERY_LEN, H, NUM_SPLITS]
    seq_lens_ptr,  # int32 [R]
    query_start_loc_ptr,  # int32 [R + 1]
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS rounded up to a power of 2
    MIN_TILES_PER_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (sm_90+)
    QUERY_LEN: tl.constexpr = 1,  # the split rows' query length (the kernel's BLOCK_Q)
    FOLD: tl.constexpr = False,  # batch-invariant mode: fold the splits in order
):
    # program (req * QUERY_LEN + query token, head)
    req = tl.program_id(0) // QUERY_LEN
    q_pos = tl.program_id(0) % QUERY_LEN
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    # The step's metadata, written before the forward began: read before the wait.
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    if USE_PDL:  # launched while the attention kernel that wrote the partials drains
        pdl_wait_and_release()
    # Only rows of QUERY_LEN tokens were split; padded rows (q_len 0) are never written.
    if (q_len != QUERY_LEN) | (seq_len <= 0):
        return
    # The split program's key range: every token of the row up to seq_len (a token's
    # keys past its causal limit left its partials at max -inf, sum 0: weight 0 here).
    num_tiles = tl.cdiv(seq_len, TILE_N)
    num_used = tl.cdiv(num_tiles, tiles_per_split(num_tiles, NUM_SPLITS, MIN_TILES_PER_SPLIT))

    offs_d = tl.arange(0, BLOCK_D)
    row = (req.to(tl.int64) * QUERY_LEN + q_pos) * num_heads + head
    if FOLD:
        _fold_splits(output_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
                     (q_start + q_pos).to(tl.int64) * stride_ot + head * stride_oh,
                     row * NUM_SPLITS, num_used, stride_od, HEAD_DIM, BLOCK_D)
        return
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < num_used
    part = row * NUM_SPLITS + offs_s
    m = tl.load(part_max_ptr + part, mask=s_valid, other=float("-inf"))
    lsum = tl.load(part_sum_ptr + part, mask=s_valid, other=0.0)
    weight = tl.where(s_valid, tl.math.exp2(m - tl.max(m, 0)), 0.0)
    denom = tl.sum(weight * lsum, 0)
    acc = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / denom
    tl.store(
        output_ptr + (q_start + q_pos).to(tl.int64) * stride_ot + head * stride_oh
        + offs_d * stride_od,
        out.to(output_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def _fold_splits(output_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, out_offset,
                 first_part, num_used, stride_od,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Batch-invariant merge of one (token, head)'s splits: fold_partial over them in
    split order, then the division the unsplit program does, so the token's output has
    the bits a program that runs its splits one after another gives it. The state is a
    [1, BLOCK_D] tile and [1] vectors, fold_partial's shapes."""
    one = tl.arange(0, 1)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d[None, :] < HEAD_DIM
    acc = tl.zeros([1, BLOCK_D], part_out_ptr.dtype.element_ty)
    l_i = tl.zeros([1], part_sum_ptr.dtype.element_ty)
    m_i = tl.full([1], float("-inf"), part_max_ptr.dtype.element_ty)
    for s in range(num_used):
        part = first_part + s + one
        acc_s = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=d_valid, other=0.0)
        acc, l_i, m_i = fold_partial(acc, l_i, m_i, acc_s, tl.load(part_sum_ptr + part),
                                     tl.load(part_max_ptr + part))
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(output_ptr + out_offset + offs_d[None, :] * stride_od,
             out.to(output_ptr.dtype.element_ty), mask=d_valid)
