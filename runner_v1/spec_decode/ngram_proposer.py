"""V1's ngram (prompt-lookup) draft proposer: host NumPy over the persistent batch's
token table, vectorised over the requests.

Semantics, per request, with t = its tokens t[0..L-1] (prompt + accepted outputs,
L = num_tokens), k = num_speculative_tokens and min_n <= n <= max_n:
- take the longest n whose suffix s = t[L-n..L-1] occurs earlier, at a start i with
  i + n <= L - 1 (so at least one token follows the occurrence; it may overlap s);
- of the occurrences of that n, take the EARLIEST (smallest i). This follows vLLM,
  whose V1 proposer (vllm/v1/spec_decode/ngram_proposer.py,
  `_find_longest_matched_ngram_and_propose_tokens`) keeps "the earliest position in
  the original tokens" and whose test says "Multiple 3-gram matched, but always pick
  the first one"; the most recent occurrence would be the other natural choice;
- propose t[i+n .. min(i+n+k, L) - 1]; no n matches: no drafts.
The drafts are then capped at max(0, max_model_len - L - 1): with d drafts the verify
step samples up to d + 1 tokens, at positions L .. L + d, and none may reach
max_model_len. (vLLM caps at max_model_len - L, one more; our cap keeps the bonus
token inside the model length too.)

How. The longest-n-first loop collapses into one search: for every candidate end
position j <= L - 2 the common-suffix length m[j] of t[..j] and t[..L-1], capped at
max_n, is the longest n-gram occurring there. Then n = max_j m[j] (when >= min_n) and
the earliest occurrence of that n is the smallest j with m[j] == n. The first pass
(t[j] == t[L-1]) compares every candidate; each further pass (d = 1 .. max_n-1) only
the survivors of the previous one. Requests are batched in buckets of candidate
counts within a factor of two (same binary exponent), each bucket one padded 2-D
compare: a padded gather and compare beat a flat ragged layout in NumPy (the ragged
one needs int64 index arrays as long as the data), and the bucketing bounds the
padding at 2x whatever the mix of lengths.

Cost: O(sum_r L_r) for the gathers and first compare (at most 2x that with padding),
plus O(survivors * max_n) for the refinement (at most sum_r L_r * max_n, far less for
a real vocabulary, where few positions share the last token); memory O(largest
bucket's rows x its longest row). Python loops: over the buckets (<= log2(max_model_len)
+ 1) and over d < max_n; none over requests or token positions. A tiny alphabet is
the slow case: there nearly every position survives every pass.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(
        self,
        num_speculative_tokens: int,
        prompt_lookup_min: int,
        prompt_lookup_max: int,
        max_model_len: int,
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min}, {prompt_lookup_max}"
            )
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(
        self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for the requests in `rows` of the token table.

        token_ids: [R, max_model_len] int32, row r valid up to num_tokens[r] (the rest is
        never read); num_tokens: [R] int32; rows: [n] int64 row indices.
        -> (drafts [n, k] int32, padded with -1; num_drafts [n] int32), in `rows` order.
        """
        rows = np.asarray(rows, dtype=np.int64)
        n = rows.shape[0]
        drafts = np.full((n, self.k), -1, dtype=np.int32)
        num_drafts = np.zeros(n, dtype=np.int32)
        lens = np.asarray(num_tokens, dtype=np.int64)[rows]
        if lens.size and (lens.min() < 0 or lens.max() > self.max_model_len):
            raise ValueError("num_tokens must lie in [0, max_model_len]")
        cap = np.minimum(self.k, self.max_model_len - lens - 1)
        # A match needs an n-gram (n >= min_n) followed by a token, so L - 1 >= min_n;
        # a row at (or one short of) max_model_len may get no drafts at all.
        active = np.flatnonzero((lens - 1 >= self.min_n) & (cap > 0))
        if active.size == 0:
            return drafts, num_drafts
        found = np.zeros(active.shape[0], dtype=bool)
        end = np.zeros(active.shape[0], dtype=np.int64)
        # Buckets of candidate counts L - 1 in [2^(e-1), 2^e): padding at most 2x.
        bucket = np.frexp(lens[active] - 1)[1]
        for e in np.unique(bucket):
            members = np.flatnonzero(bucket == e)
            found[members], end[members] = self._longest_earliest_match(
                token_ids, rows[active[members]], lens[active[members]])
        sel = active[found]
        start = end[found] + 1  # the first token after the occurrence
        count = np.minimum(cap[sel], lens[sel] - start)
        offsets = np.arange(self.k)
        # Clip the columns: a slot past `count` is masked to -1, but must not index
        # outside the table while it is gathered.
        cols = np.minimum(start[:, None] + offsets, self.max_model_len - 1)
        values = token_ids[rows[sel][:, None], cols]
        drafts[sel] = np.where(offsets < count[:, None], values, -1)
        num_drafts[sel] = count
        return drafts, num_drafts

    def _longest_earliest_match(
        self, token_ids: np.ndarray, rows: np.ndarray, lens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For rows with L >= 2: (found [a] bool, end [a] int64), end = the last position
        j of the earliest occurrence of the longest suffix n-gram (n <= max_n), valid
        where found (n >= min_n)."""
        a = rows.shape[0]
        width = int(lens.max()) - 1  # candidate end positions j = 0 .. L-2
        window = token_ids[rows, :width]  # padded past L - 1: masked below
        # suffix[r, d] = t[L-1-d]; clipped at 0 where d > L-1 (never read: a candidate
        # reaches depth d only when j >= d, and j <= L-2).
        depth = np.arange(self.max_n)
        suffix = token_ids[rows[:, None], np.maximum(lens[:, None] - 1 - depth, 0)]

        # Depth 0: candidates ending on the last token; every survivor has m >= 1.
        hit = (window == suffix[:, :1]) & (np.arange(width) < (lens - 1)[:, None])
        cand_req, cand_j = np.nonzero(hit)  # row-major: grouped by request, j ascending
        length = np.ones(cand_req.shape[0], dtype=np.int64)
        alive = np.arange(cand_req.shape[0])
        for d in range(1, self.max_n):
            req, j = cand_req[alive], cand_j[alive]
            prev = window[req, np.maximum(j - d, 0)]  # t[j-d] where j >= d
            alive = alive[(j >= d) & (prev == suffix[req, d])]
            if alive.size == 0:
                break
            length[alive] += 1

        # Per request: the longest length, then the smallest j, as one max over a key
        # (j < max_model_len).
        m1 = self.max_model_len + 1
        key = length * m1 - cand_j
        found = np.zeros(a, dtype=bool)
        end = np.zeros(a, dtype=np.int64)
        if key.size:
            first = np.flatnonzero(np.r_[True, cand_req[1:] != cand_req[:-1]])
            reqs = cand_req[first]
            best = np.maximum.reduceat(key, first)
            best_len = -(-best // m1)
            found[reqs] = best_len >= self.min_n
            end[reqs] = best_len * m1 - best
        return found, end
