"""A draft model's own sampling, shared by both runners so that V1 and V2 propose the
same drafts: the draft distribution q and a token drawn from it.

q is softmax(x / T) over the whole vocabulary in float64 (no top-k / top-p: the target's
filters act in the rejection sampler, and the standard rule is exact for any q), and the
draft token is Gumbel-max over the same scaled logits, which draws from exactly that q.
The noise is the shared seeded noise under the request's seed salted with DRAFT_SALT:
keyed like the target's noise it would correlate the draft with the acceptance and
recovery draws and bias the rejection sampler (vLLM #47386). The noise of draft i of a
proposal is keyed by (the proposal's first input position) * 32 + i, not by draft i's
own position: block verification reads every draft of a step, also those after the
point where it stops, and the next step drafts at those positions again; keyed by
position it would reuse noise the last outcome has already conditioned (the same reason
block verification keys its uniforms by the step's first row). The first position grows
every step, so a key is never reused. Greedy rows (T == 0) take the argmax and need no
q: the rejection samplers verify them by exact match.
"""

from __future__ import annotations

import torch

from shared.sampling.noise import DRAFT_SALT, gumbel_noise

# draft i's noise key: first position * DRAFT_KEY_STRIDE + i (k <= 16 < the stride)
DRAFT_KEY_STRIDE = 32


def sample_draft(
    logits: torch.Tensor, temperature: torch.Tensor | None, seeds: torch.Tensor | None,
    first_positions: torch.Tensor, index: int, want_probs: bool = True,
    all_greedy: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [n, V] (draft model, any float dtype); temperature float32 [n] (0 = greedy);
    seeds int64 [n] (the requests' seeds, unsalted); first_positions int64 [n] (the input
    position of each proposal's first draft forward); index: which draft (0-based).
    Returns (draft tokens int64 [n], q float64 [n, V] or None when not wanted or every
    row is greedy). all_greedy: whether every row is greedy, from the caller's host state;
    None reads it from `temperature` (a device sync on CUDA: the runners pass it); when
    True, temperature, seeds and first_positions are not read."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute)
    if all_greedy is None:
        all_greedy = bool((temperature == 0).all())
    if all_greedy:  # temperature, seeds and positions are not read (they may be None)
        return x.argmax(dim=-1), None
    greedy = temperature == 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(compute)
    scaled = x / temp[:, None]
    keys = first_positions.to(torch.int64) * DRAFT_KEY_STRIDE + index
    noise = gumbel_noise(seeds ^ DRAFT_SALT, keys, x.shape[1])
    tokens = torch.where(greedy, x.argmax(dim=-1), noise.add_(scaled).argmax(dim=-1))
    probs = torch.softmax(scaled.to(torch.float64), dim=-1) if want_probs else None
    return tokens, probs
