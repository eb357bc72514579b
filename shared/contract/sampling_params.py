"""SamplingParams with vLLM's meaning, validated once at construction.

Both runners keep every float field in float32 and the samplers divide logits by the
temperature and by / times the repetition penalty. The bounds below keep each of those
operations finite for finite logits in float32, so no NaN (e.g. a masked -inf logit
divided by an infinite temperature) can reach an argmax: V1's torch argmax picks a NaN,
V2's Triton argmax does not, and the runners would disagree.

Accepted types: a float field takes a real number (int, float, or a NumPy integer /
floating scalar; stored as a Python float); an integer field takes an int or a NumPy
integer scalar (stored as an int). bool is refused everywhere a number is expected,
and so is str: neither is a number a caller means to pass.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, NoReturn

import numpy as np

# top_k values that mean "no top-k" (vLLM accepts both).
_NO_TOP_K = (0, -1)

# Any temperature in [0, GREEDY_TEMPERATURE_EPS) is greedy and is stored as exactly 0.0,
# so both runners take their greedy path by construction (vLLM's threshold). Below it,
# float32 logits / T overflow: at T = 1e-39 every logit above ~3.4e-1 becomes +inf and
# the lowest such id wins, not the greedy token. At the threshold itself, x / T stays
# finite for any |x| < 3.4e33.
GREEDY_TEMPERATURE_EPS = 1e-5

# The largest temperature. Any finite float32 T keeps -inf / T = -inf (an infinite T
# makes a masked logit NaN); 1e4 also keeps x / T a normal float32 for every
# |x| >= 1.2e-34, so no runner's flush-to-zero of subnormals can change a result. Nothing
# is lost above it: for logits within +-100, x / 1e4 varies by under 0.02, i.e. sampling
# is already uniform to within 2%. 1e4 is exact in float32.
MAX_TEMPERATURE = 1e4

# repetition_penalty r bounds (1 = off). Seen tokens get x / r (x > 0) or x * r (x <= 0).
# Both bounds are normal float32 numbers, so r never rounds to 0 or inf; x / r and x * r
# then stay finite for any |x| < 3.4e35, and after the greedy-threshold division by T
# (>= 1e-5) for any |x| < 3.4e30: far beyond any real logit. vLLM's useful range is
# about [1, 2]; values below 1 reward repetition.
MIN_REPETITION_PENALTY = 1e-3
MAX_REPETITION_PENALTY = 1e3

# presence_penalty and frequency_penalty range (vLLM's).
MAX_ABS_PENALTY = 2.0

# logit_bias values are clamped to this range by vLLM; here a value outside is refused.
MAX_ABS_LOGIT_BIAS = 100.0

# Per-request table sizes. V2 keeps each built-in in a fixed-width per-slot device table
# (runner_v2/sample/), and the engine refuses more at admission so that both runners
# accept exactly the same requests and none fails mid-step. vLLM's V2 uses the same limits.
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_TOTAL_TOKENS = 1024

_REAL = "a real number (int or float)"
_INTEGER = "an int"


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type; the message names the
    field, the value and what is accepted."""


def _is_integer(value: object) -> bool:
    # bool is an int subclass, np.bool_ is not an np.integer: refuse the former here.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return _is_integer(value) or isinstance(value, (float, np.floating))


class RequestOutputKind(Enum):
    """What LLMEngine.step() returns for a request (vLLM's kinds). CUMULATIVE: after every
    step that advanced it, its whole output so far. DELTA: only what the step added (new
    token ids, logprobs and settled text, see shared/serving/output_delta.py; the prompt
    logprobs in the first output only; cumulative_logprob stays the running sum).
    FINAL_ONLY: one output, when it finishes: what offline generation needs, and no
    per-step copy of every request's output."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # [0, MAX_TEMPERATURE]; below GREEDY_TEMPERATURE_EPS: 0 (greedy)
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY]
    # parallel samples of the prompt: sample i uses derive_sample_seed(seed, i)
    n: int = 1
    # stop strings, matched on the incrementally detokenised output (needs a tokenizer)
    stop: str | list[str] | None = None  # stored as a list (empty: none)
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> bias added before temperature
    allowed_token_ids: list[int] | None = None  # None: every token; else only these
    # banned words: text (tokenised by the engine, needs a tokenizer) ...
    bad_words: list[str] | None = None
    # ... or token sequences (runnerlab's form for models without a tokenizer). The last
    # token of a word is banned when the output ends with the word's other tokens.
    bad_words_token_ids: list[list[int]] | None = None
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt token
    extra_args: dict[str, Any] | None = None  # handed to custom logits processors
    skip_special_tokens: bool = True  # of the output text
    # a RequestOutputKind, or its value ("cumulative" | "delta" | "final_only")
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Idempotent: the engine re-runs it through dataclasses.replace at admission.
        self._validate()
        if self.top_k in _NO_TOP_K:
            self.top_k = 0
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0

    def _fail(self, name: str, value: object, accepted: str, why: str = "") -> NoReturn:
        raise SamplingParamsError(
            f"SamplingParams.{name}={value!r} is invalid: expected {accepted}{why}."
        )

    def _real(self, name: str, accepted: str, in_range: Callable[[float], bool]) -> None:
        """Store the field as a Python float, or raise SamplingParamsError naming the
        value as the caller passed it."""
        value = getattr(self, name)
        if not _is_real(value):
            self._fail(name, value, accepted, f", not a {type(value).__name__}")
        try:
            number = float(value)
        except OverflowError:  # an int beyond float64's range
            number = math.inf
        if not (math.isfinite(number) and in_range(number)):
            self._fail(name, value, accepted)
        setattr(self, name, number)

    def _integer(self, name: str, accepted: str, in_range: Callable[[int], bool],
                 optional: bool = False) -> None:
        """Store the field as a Python int (None kept when optional), or raise
        SamplingParamsError naming the value as the caller passed it."""
        value = getattr(self, name)
        if optional and value is None:
            return
        if not _is_integer(value):
            self._fail(name, value, accepted, f", not a {type(value).__name__}")
        if not in_range(int(value)):
            self._fail(name, value, accepted)
        setattr(self, name, int(value))

    def _validate(self) -> None:
        self._validate_integers()
        self._validate_stop_token_ids()
        self._validate_reals()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                self._fail(name, value, "a bool", f", not a {type(value).__name__}")
            setattr(self, name, bool(value))
        self._validate_output_kind()
        self._validate_stop()
        self._validate_logit_bias()
        self._validate_allowed_token_ids()
        self._validate_bad_words()
        if self.extra_args is not None and not isinstance(self.extra_args, Mapping):
            self._fail("extra_args", self.extra_args, "None or a dict",
                       f", not a {type(self.extra_args).__name__}")
        if self.extra_args is not None:
            self.extra_args = dict(self.extra_args)

    def _validate_output_kind(self) -> None:
        kind = self.output_kind
        if isinstance(kind, str) and not isinstance(kind, RequestOutputKind):
            try:
                kind = RequestOutputKind(kind)
            except ValueError:
                pass
        if not isinstance(kind, RequestOutputKind):
            self._fail("output_kind", self.output_kind, "a RequestOutputKind or one of "
                       + ", ".join(repr(k.value) for k in RequestOutputKind))
        self.output_kind = kind

    def _token_ids(self, name: str, value: object, accepted: str, where: str = "") -> list[int]:
        """A list of non-negative ints from any iterable of them (not a str), or fail."""
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            self._fail(name, value, accepted, f", not a {type(value).__name__}{where}")
        ids = list(value)
        for i, t in enumerate(ids):
            if not _is_integer(t):
                self._fail(name, value, accepted, f", not a {type(t).__name__} at index {i}{where}")
            if t < 0:
                self._fail(name, value, accepted, f" (negative id at index {i}{where})")
        return [int(t) for t in ids]

    def _validate_stop(self) -> None:
        accepted = "None, a non-empty str or a list of non-empty strs"
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, bytes) or not isinstance(stop, Iterable):
            self._fail("stop", stop, accepted, f", not a {type(stop).__name__}")
        stop = list(stop)
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                self._fail("stop", self.stop, accepted, f" (item {i} is {s!r})")
        self.stop = list(dict.fromkeys(stop))

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        accepted = (f"None or a dict of token id (int >= 0) -> bias ({_REAL} in "
                    f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}])")
        if not isinstance(self.logit_bias, Mapping):
            self._fail("logit_bias", self.logit_bias, accepted,
                       f", not a {type(self.logit_bias).__name__}")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            # JSON object keys are strings: accept "123" as vLLM's OpenAI server does
            token = int(key) if isinstance(key, str) and key.isdigit() else key
            if not _is_integer(token) or token < 0:
                self._fail("logit_bias", self.logit_bias, accepted, f" (key {key!r})")
            if not _is_real(value) or not (math.isfinite(float(value))
                                           and abs(float(value)) <= MAX_ABS_LOGIT_BIAS):
                self._fail("logit_bias", self.logit_bias, accepted, f" (value {value!r})")
            bias[int(token)] = float(value)
        self.logit_bias = bias

    def _validate_allowed_token_ids(self) -> None:
        if self.allowed_token_ids is None:
            return
        accepted = "None or a non-empty list of token ids (ints >= 0)"
        ids = self._token_ids("allowed_token_ids", self.allowed_token_ids, accepted)
        if not ids:
            self._fail("allowed_token_ids", self.allowed_token_ids, accepted,
                       " (an empty list would allow no token)")
        self.allowed_token_ids = list(dict.fromkeys(ids))

    def _validate_bad_words(self) -> None:
        if self.bad_words is not None:
            accepted = "None or a list of non-empty strs"
            if isinstance(self.bad_words, (str, bytes)) or not isinstance(self.bad_words, Iterable):
                self._fail("bad_words", self.bad_words, accepted,
                           f", not a {type(self.bad_words).__name__}")
            words = list(self.bad_words)
            for i, w in enumerate(words):
                if not isinstance(w, str) or not w:
                    self._fail("bad_words", self.bad_words, accepted, f" (item {i} is {w!r})")
            self.bad_words = words
        if self.bad_words_token_ids is not None:
            accepted = "None or a list of non-empty token id lists (ints >= 0)"
            value = self.bad_words_token_ids
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                self._fail("bad_words_token_ids", value, accepted,
                           f", not a {type(value).__name__}")
            words = [self._token_ids("bad_words_token_ids", w, accepted, f" of word {i}")
                     for i, w in enumerate(value)]
            if any(not w for w in words):
                self._fail("bad_words_token_ids", value, accepted, " (an empty word)")
            self.bad_words_token_ids = words

    def _validate_integers(self) -> None:
        self._integer("max_tokens", f"{_INTEGER} >= 1", lambda n: n >= 1)
        self._integer("top_k", f"{_INTEGER} >= 1, or 0 / -1 to disable", lambda k: k >= -1)
        self._integer("seed", f"None or {_INTEGER} in [0, 2**63)", lambda s: 0 <= s < 2**63,
                      optional=True)
        max_tokens = self.max_tokens
        self._integer("min_tokens", f"{_INTEGER} in [0, max_tokens={max_tokens}]",
                      lambda n: 0 <= n <= max_tokens)
        self._integer("logprobs", f"None or {_INTEGER} >= 0", lambda n: n >= 0, optional=True)
        self._integer("prompt_logprobs", f"None or {_INTEGER} >= 0", lambda n: n >= 0,
                      optional=True)
        self._integer("n", f"{_INTEGER} >= 1", lambda n: n >= 1)

    def _validate_stop_token_ids(self) -> None:
        accepted = "a list of non-negative token ids (ints)"
        value = self.stop_token_ids
        # A str (or bytes) is iterable but is never a list of ids; None is not iterable.
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            self._fail("stop_token_ids", value, accepted, f", not a {type(value).__name__}")
        ids = list(value)
        for i, t in enumerate(ids):
            if not _is_integer(t):
                self._fail("stop_token_ids", value, accepted,
                           f", not a {type(t).__name__} at index {i}")
            if t < 0:
                self._fail("stop_token_ids", value, accepted)
        self.stop_token_ids = [int(t) for t in ids]

    def _validate_reals(self) -> None:
        self._real("temperature", f"{_REAL} in [0, {MAX_TEMPERATURE:g}] (0, or below "
                   f"{GREEDY_TEMPERATURE_EPS:g}: greedy)", lambda t: 0.0 <= t <= MAX_TEMPERATURE)
        self._real("top_p", f"{_REAL} in (0, 1]", lambda p: 0.0 < p <= 1.0)
        self._real("min_p", f"{_REAL} in [0, 1]", lambda p: 0.0 <= p <= 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            self._real(name, f"{_REAL} in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}]",
                       lambda p: -MAX_ABS_PENALTY <= p <= MAX_ABS_PENALTY)
        self._real("repetition_penalty",
                   f"{_REAL} in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)",
                   lambda r: MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_builtin_processors(self) -> bool:
        """logit_bias, allowed_token_ids or bad words (text or ids) are set."""
        return bool(self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words or self.bad_words_token_ids)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


SAMPLING_PARAMS_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))
_dataclass_init = SamplingParams.__init__


def _init_naming_unknown_fields(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    # The dataclass __init__ would raise a bare TypeError ("unexpected keyword argument");
    # a user who misspells a vLLM field (or passes one runnerlab lacks) gets its name and
    # the accepted ones instead.
    unknown = [k for k in kwargs if k not in SAMPLING_PARAMS_FIELDS]
    if unknown:
        raise SamplingParamsError(
            f"SamplingParams got unknown field(s) {', '.join(map(repr, unknown))}; accepted "
            f"fields: {', '.join(SAMPLING_PARAMS_FIELDS)}."
        )
    _dataclass_init(self, *args, **kwargs)


SamplingParams.__init__ = _init_naming_unknown_fields  # type: ignore[method-assign]


def derive_sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request with n > 1: sample 0 keeps the request's
    seed (n = 1 is unchanged); the others get a hash of (seed, index) in [0, 2**63), so
    the samples' noise streams are unrelated to each other and to nearby seeds."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
