"""IncrementalDetokenizer and decode_token against SmolLM2's tokenizer.

Oracles: the tokenizer's own decode of the whole output (the text), and a brute-force
stop-string search over decode of every output prefix (which token ends the request, on
which stop string, with what text). Token sequences are seeded-random mixtures of text
pieces (ASCII, accented, CJK, emoji with ZWJ and flags, whose bytes are split over
tokens), stray pieces of multibyte characters, special tokens and random vocabulary ids.

Documented difference from decode(output_ids): the held-back tail. While the text ends
in U+FFFD (an incomplete UTF-8 sequence), the last tokens' text is not emitted; it appears
once a later token completes (or definitely breaks) the sequence. The comparisons check
that output_text is decode's text less such a tail, and equality after one more ASCII
token.
"""

from __future__ import annotations

import random

import pytest

from shared import SamplingParams
from shared.serving.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatchedError,
    decode_token,
)
from tests.shared.serving.metaspace_tokenizer import metaspace_tokenizer

TEXTS = [
    " Hello world, this is a test.",
    "def f(x):\n    return x ** 2\n",
    " naïve café, señor Müller; Ærøskøbing",
    " 漢字とかなカナ、한국어 텍스트",
    " 😀🎉 🇫🇷🇯🇵 👨‍👩‍👧‍👦 👍🏽",
    " €£¥ ≈√∫ Ω µ ½ ‰",
    "\n\n\t  multiple   spaces\r\n",
    " Ünïcödé ‘quotes’ “double” — dash … ellipsis",
]
PROMPTS = [
    "",
    " The answer is",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\n😀 café<|im_end|>\n",
]
NUM_SPECIAL = 17  # SmolLM2's added tokens 0..16, all special


@pytest.fixture(scope="module")
def tok():
    from shared.model.gguf import find_smollm2_gguf, load_gguf_tokenizer

    return load_gguf_tokenizer(find_smollm2_gguf())  # pinned: a missing package fails


@pytest.fixture(scope="module")
def pools(tok):
    """Token pools: the texts' tokens and their pieces that are not whole characters."""
    texts = [tok.encode(t) for t in TEXTS]
    partial = sorted({i for ids in texts for i in ids if "\ufffd" in tok.decode([i])})
    assert len(partial) > 20, "the multibyte texts should split characters over tokens"
    return texts, partial


def random_ids(rng: random.Random, tok, pools, length: int, specials: bool = True) -> list[int]:
    texts, partial = pools
    ids: list[int] = []
    while len(ids) < length:
        kind = rng.random()
        if kind < 0.45:
            text = rng.choice(texts)
            start = rng.randrange(len(text))
            ids += text[start:start + rng.randint(1, 8)]
        elif kind < 0.65:
            ids += rng.choices(partial, k=rng.randint(1, 3))
        elif kind < 0.8 and specials:
            ids.append(rng.randrange(NUM_SPECIAL))
        else:
            ids.append(rng.randrange(len(tok)))
    return ids[:length]


def detokenize(tok, prompt: list[int], ids: list[int], **params) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))
    for i in ids:
        assert d.append(i) is None
    return d


# ---------------------------------------------------------------------------------------
# text against decode


@pytest.mark.parametrize("skip", [True, False])
def test_output_text_equals_decode(tok, pools, skip):
    rng = random.Random(1234 + skip)
    flush = tok.encode(".")
    assert len(flush) == 1
    held_steps = 0
    for _ in range(150):
        prompt = tok.encode(rng.choice(PROMPTS))
        ids = random_ids(rng, tok, pools, rng.randint(1, 40))
        d = IncrementalDetokenizer(tok, prompt, SamplingParams(skip_special_tokens=skip))
        for k, i in enumerate(ids, 1):
            assert d.append(i) is None
            full = tok.decode(ids[:k], skip_special_tokens=skip)
            out = d.output_text
            assert full.startswith(out), (ids[:k], out, full)
            rest = full[len(out):]
            assert rest == "" or rest.endswith("\ufffd"), (ids[:k], out, full)
            held_steps += rest != ""
        d.append(flush[0])
        assert d.output_text == tok.decode(ids + flush, skip_special_tokens=skip), ids
    assert held_steps > 100, "the sequences should often end in an incomplete character"


def test_special_tokens_follow_the_setting(tok):
    ids = tok.encode(" Hi<|im_end|><file_sep> there<|endoftext|>")
    assert {2, 5, 0} <= set(ids)
    for skip in (True, False):
        out = detokenize(tok, [], ids, skip_special_tokens=skip).output_text
        assert out == tok.decode(ids, skip_special_tokens=skip)
    assert detokenize(tok, [], ids, skip_special_tokens=True).output_text == " Hi there"


def test_prompt_seeds_the_first_token_context():
    """A SentencePiece (Metaspace) decoder drops the leading space of a sequence's first
    token; the prompt's last tokens before it keep the output's own leading space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581The": 1, "\u2581cat": 2, "s": 3, "\u2581sat": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt, out = [1], [2, 3, 4]
    in_context = sp.decode(prompt + out)[len(sp.decode(prompt)):]
    assert in_context == " cats sat"
    assert detokenize(sp, prompt, out).output_text == in_context
    assert detokenize(sp, [], out).output_text == sp.decode(out) == "cats sat"


class CountingTokenizer:
    """The tokenizer, recording the longest id list any decode call was given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.longest = 0
        self.total = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        self.total += len(ids)
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
def test_cost_is_bounded_per_token(tok, pools, skip):
    """Long runs of stray multibyte pieces (never completing a character) and of special
    tokens (decoding to nothing when skipped) keep the window bounded; the text is still
    decode's."""
    texts, partial = pools
    continuation = [i for i in partial if tok.decode([i]) == "\ufffd"]
    rng = random.Random(7)
    ids: list[int] = []
    for _ in range(40):
        run = rng.choice([continuation, list(range(NUM_SPECIAL)), rng.choice(texts)])
        ids += rng.choices(run, k=rng.randint(10, 40))
    ids += tok.encode(".")
    counting = CountingTokenizer(tok)
    d = detokenize(counting, tok.encode(PROMPTS[1]), ids, skip_special_tokens=skip)
    assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
    # the promise, written out: at most 7 prompt ids of context, 8 held ids, 2 more
    bound = 17
    assert counting.longest <= bound, counting.longest
    assert counting.total <= 4 * bound * len(ids)


# ---------------------------------------------------------------------------------------
# stop strings


def reference_stop(tok, ids, stops, include, min_tokens, skip=True):
    """(index of the stopping token, stop string, output text) or None, by brute force:
    the visible text after token k is decode(ids[:k]) unless that ends in U+FFFD (then the
    previous visible text); a stop string counts at token k > min_tokens if it ends in
    the text token k made visible; the first to end wins, then the first to start."""
    visible = ""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=skip)
        if text.endswith("\ufffd") or len(text) <= len(visible):
            continue
        before, visible = len(visible), text
        if k <= min_tokens:
            continue
        hits = [(i + len(s), i, s) for s in stops for i in range(len(text))
                if text.startswith(s, i) and i + len(s) > before]
        if hits:
            end, start, s = min(hits)
            return k - 1, s, text[:end if include else start]
    return None


def run_until_stop(tok, prompt, ids, **params):
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))
    for k, i in enumerate(ids):
        stop = d.append(i)
        if stop is not None:
            assert d.stop_reason == stop
            return d, (k, stop, d.output_text)
    return d, None


def test_stop_strings_against_brute_force(tok, pools):
    rng = random.Random(99)
    matched = 0
    for _ in range(150):
        ids = random_ids(rng, tok, pools, rng.randint(2, 30), specials=False)
        text = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stop = text[start:start + rng.randint(1, 6)].replace("\ufffd", "")
            stops.append(stop or "zq")
        params = dict(stop=stops, include_stop_str_in_output=rng.random() < 0.5,
                      min_tokens=rng.randint(0, 3))
        want = reference_stop(tok, ids, list(dict.fromkeys(stops)),
                              params["include_stop_str_in_output"], params["min_tokens"])
        _, got = run_until_stop(tok, tok.encode(rng.choice(PROMPTS)), ids, **params)
        assert got == want, (ids, params)
        matched += want is not None
    assert matched > 75


def tokens_of(tok, pieces: list[str]) -> list[int]:
    """One token per piece (checked), so each test knows where the token edges are."""
    ids = [tok.encode(p) for p in pieces]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


HELLO = [" Hello", " world", " foo", " bar"]


@pytest.mark.parametrize("include", [False, True])
def test_stop_split_over_tokens(tok, include):
    ids = tokens_of(tok, HELLO)
    # "lo wo": two tokens, found at the second; "lo world f": three, found at the third
    for stop, at in (("lo wo", 1), ("lo world f", 2)):
        d, got = run_until_stop(tok, [], ids, stop=stop, include_stop_str_in_output=include)
        full = "".join(HELLO)
        start = full.index(stop)
        assert got == (at, stop, full[:start + len(stop) if include else start])


@pytest.mark.parametrize("include", [False, True])
def test_stop_inside_one_token(tok, include):
    d, got = run_until_stop(tok, [], tokens_of(tok, HELLO), stop="ell",
                            include_stop_str_in_output=include)
    # the rest of the token (the final "o") is dropped either way
    assert got == (0, "ell", " Hell" if include else " H")


@pytest.mark.parametrize("include", [False, True])
def test_earliest_stop_wins(tok, include):
    ids = tokens_of(tok, HELLO)
    # both end in " world"; "wor" ends first although listed second
    d, got = run_until_stop(tok, [], ids, stop=["orld", "wor"], include_stop_str_in_output=include)
    assert got == (1, "wor", " Hello wor" if include else " Hello ")
    # overlapping in one token: "ell" ends before "Hello" does
    d, got = run_until_stop(tok, [], ids, stop=["Hello", "ell"], include_stop_str_in_output=include)
    assert got == (0, "ell", " Hell" if include else " H")
    # the same end: the one starting first
    d, got = run_until_stop(tok, [], ids, stop=["llo", "Hello"], include_stop_str_in_output=include)
    assert got == (0, "Hello", " Hello" if include else " ")


def test_stop_spanning_prompt_and_output_does_not_match(tok):
    prompt = tokens_of(tok, [" Hello"])
    out = tokens_of(tok, [" world", " foo"])
    for stop in ("o w", "Hello world", "lo"):
        d, got = run_until_stop(tok, prompt, out, stop=stop)
        assert got is None and d.output_text == " world foo"
    d, got = run_until_stop(tok, prompt, out, stop=["o w", "d f"])
    assert got == (1, "d f", " worl")


def test_stop_with_multibyte_characters(tok):
    ids = tok.encode(" café 😀 done")
    for stop in ("é 😀", "😀", "\U0001F600 d"):
        want = reference_stop(tok, ids, [stop], False, 0)
        assert want is not None
        assert run_until_stop(tok, [], ids, stop=stop)[1] == want


def test_min_tokens_delays_stop_strings(tok):
    ids = tokens_of(tok, HELLO)
    # " world" is token 2: within min_tokens=2 its "world" never counts later
    d, got = run_until_stop(tok, [], ids, stop="world", min_tokens=2, max_tokens=4)
    assert got is None
    # "lo wo" completes at token 2 > min_tokens=1, though it starts in token 1
    d, got = run_until_stop(tok, [], ids, stop="lo wo", min_tokens=1, max_tokens=4)
    assert got == (1, "lo wo", " Hel")


def test_append_after_stop_raises(tok):
    ids = tokens_of(tok, HELLO)
    d, got = run_until_stop(tok, [], ids, stop="world")
    assert got is not None
    with pytest.raises(StopStringMatchedError, match="world"):
        d.append(ids[-1])


@pytest.mark.parametrize("include", [False, True])
def test_streamed_deltas_never_retract(tok, pools, include):
    """Deltas concatenate to output_text, and nothing streamed is later cut away by a stop
    string: the last len(stop) - 1 characters wait until the request finishes."""
    rng = random.Random(5 + include)
    for _ in range(60):
        ids = random_ids(rng, tok, pools, rng.randint(2, 30))
        text = tok.decode(ids)
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 6)].replace("\ufffd", "") or "zq"
        d = IncrementalDetokenizer(tok, [], SamplingParams(
            stop=[stop, "zzzzzzz"], include_stop_str_in_output=include))
        streamed = ""
        for i in ids:
            stopped = d.append(i) is not None
            streamed += d.new_text_since_last_call()
            if stopped:
                break
            assert d.output_text.startswith(streamed)
            assert len(d.output_text) - len(streamed) <= (0 if include else 6)
        streamed += d.new_text_since_last_call(finished=True)
        assert streamed == d.output_text
        assert d.new_text_since_last_call(finished=True) == ""


# ---------------------------------------------------------------------------------------
# decode_token


def test_decode_token(tok, pools):
    _, partial = pools
    for i in [*tok.encode(" Paris café"), 0, 2, 16, partial[0], len(tok) - 1]:
        want = tok.convert_tokens_to_string([tok.convert_ids_to_tokens(i)])
        assert decode_token(tok, i) == want
    assert decode_token(tok, 2) == "<|im_end|>"
    assert decode_token(tok, partial[0]).endswith("\ufffd")
    assert decode_token(tok, len(tok)) == "" and decode_token(tok, -1) == ""


@pytest.mark.parametrize("skip", [True, False])
def test_final_text_is_decode_also_with_a_held_tail(tok, pools, skip):
    """A request that ends on an incomplete character: final_text shows the held tail as
    a whole decode does (U+FFFD), output_text still holds it back."""
    rng = random.Random(99 + skip)
    ended_held = 0
    for _ in range(150):
        prompt = tok.encode(rng.choice(PROMPTS))
        ids = random_ids(rng, tok, pools, rng.randint(1, 40))
        d = detokenize(tok, prompt, ids, skip_special_tokens=skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        assert d.final_text() == full, (ids, d.final_text(), full)
        ended_held += d.output_text != full
    assert ended_held > 30, "many sequences should end in an incomplete character"


def test_final_text_after_a_stop_string_is_the_cut_text(tok):
    ids = tok.encode("alpha beta gamma delta")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=[" gamma"]))
    reasons = []
    for i in ids:
        reasons.append(d.append(i))
        if reasons[-1] is not None:
            break
    assert reasons[-1] == " gamma"
    assert d.final_text() == d.output_text == "alpha beta"


@pytest.mark.parametrize("which", ["smollm2", "metaspace"])
@pytest.mark.parametrize("skip", [True, False])
def test_decode_whole_is_the_final_text_of_appending_every_id(tok, pools, which, skip):
    """FINAL_ONLY's one decode against the token-by-token oracle (CUMULATIVE's text)."""
    rng = random.Random(7 + skip)
    sp = metaspace_tokenizer(512) if which == "metaspace" else None
    leading_space = split_character = 0
    for k in range(300):
        if sp is None:  # half the prompts from pieces: some end inside a character
            prompt = (tok.encode(rng.choice(PROMPTS)) if k % 2 else
                      random_ids(rng, tok, pools, rng.randint(0, 9), specials=False))
            ids = random_ids(rng, tok, pools, rng.randint(1, 40))
            t = tok
            split_character += tok.decode(prompt).endswith("\ufffd")
        else:
            prompt = [rng.randrange(1, 512) for _ in range(rng.randint(0, 9))]
            ids = [rng.randrange(600) for _ in range(rng.randint(1, 40))]  # some outside
            t = sp
        params = SamplingParams(skip_special_tokens=skip)
        whole = IncrementalDetokenizer(t, prompt, params).decode_whole(ids)
        assert whole == detokenize(t, prompt, ids, skip_special_tokens=skip).final_text(), (
            prompt, ids)
        leading_space += bool(prompt) and whole.startswith(" ")
    if sp is not None:  # the case the prompt's context decides
        assert leading_space > 30
    else:
        assert split_character > 20
