"""The OpenAI request bodies `runnerlab serve` accepts, and their mapping to SamplingParams.

Every field a request may carry is declared here; anything else is refused by name
(pydantic's extra="forbid"), so an OpenAI option runnerlab does not implement (tools,
response_format, echo, ...) is a 400 that names it, never silently ignored. Types are
strict: a number where a string belongs, or true where an int belongs, is refused too.
Besides OpenAI's fields, the sampling extensions vLLM's server takes (top_k, min_p,
repetition_penalty, ignore_eos, ...) and vLLM's `return_token_ids` are accepted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.contract.sampling_params import SamplingParams, SamplingParamsError


class APIError(Exception):
    """A request the server refuses: HTTP status, OpenAI error type and the field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # None: the served model
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # each choice (and each streamed chunk's choice) carries its new token ids
    return_token_ids: bool = False

    def _sampling_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            n=self.n, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            top_k=self.top_k, min_p=self.min_p, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, stop=self.stop, seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
        )
        # OpenAI's defaults where the request leaves them out
        kwargs["temperature"] = 1.0 if self.temperature is None else self.temperature
        kwargs["top_p"] = 1.0 if self.top_p is None else self.top_p
        return kwargs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # top log-probabilities per token (the sampled one too)
    # OpenAI fields accepted only at the value that changes nothing
    echo: Literal[False] = False
    best_of: int | None = None
    suffix: None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty; pass a string, a list of strings, a list of "
                                "token ids or a list of token-id lists", "prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} is not supported (only best_of == n, "
                                f"n={self.n}); leave best_of out", "best_of")
        kwargs = self._sampling_kwargs()
        kwargs["logprobs"] = self.logprobs
        kwargs["max_tokens"] = _max_tokens(self.max_tokens, "max_tokens", prompt_len,
                                           max_model_len)
        return build_sampling_params(kwargs, _COMPLETION_NAMES)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages content part {i} has type {part.get('type')!r}; "
                                    "only text parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extension

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "pass max_completion_tokens or max_tokens, not both",
                           "max_completion_tokens")
        name = "max_tokens" if self.max_tokens is not None else "max_completion_tokens"
        kwargs = self._sampling_kwargs()
        kwargs["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        kwargs["max_tokens"] = _max_tokens(
            self.max_tokens if self.max_tokens is not None else self.max_completion_tokens,
            name, prompt_len, max_model_len)
        return build_sampling_params(kwargs, CHAT_FIELD_NAMES)


# SamplingParams field -> the request field a refusal names, where they differ
_COMPLETION_NAMES: dict[str, str] = {}
CHAT_FIELD_NAMES = {"logprobs": "top_logprobs"}


def _max_tokens(value: int | None, name: str, prompt_len: int, max_model_len: int) -> int:
    """The request's max_tokens, or what fits the context; a prompt that leaves no room
    is the client's error (400), named by its length."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context holds "
                            f"{max_model_len} (max_model_len), which leaves no room for "
                            "output: shorten the prompt", "prompt")
    if value is None:
        return room
    if value < 1:
        raise APIError(400, f"{name}={value} is invalid: expected an int >= 1", name)
    return value


def build_sampling_params(kwargs: dict[str, Any], names: dict[str, str]) -> SamplingParams:
    """SamplingParams(**kwargs), a range error becoming a 400 that names the field."""
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        field = str(exc).split("=", 1)[0].removeprefix("SamplingParams.")
        param = names.get(field, field)
        raise APIError(400, str(exc).replace(f"SamplingParams.{field}", param), param) from exc


def parse_body(model: type[BaseModel], body: Any) -> Any:
    """A decoded JSON body -> the request model, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body is a JSON {type(body).__name__}; send a JSON "
                            "object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise APIError(400, *_first_error(exc.errors(), body)) from exc


def _first_error(errors: list[Any], body: dict[str, Any]) -> tuple[str, str | None]:
    """(message, field) of pydantic's first error. A union field (prompt, stop, content)
    reports one error per accepted type: those become one message listing the types."""
    err = errors[0]
    field = str(err["loc"][0]) if err["loc"] else None
    loc = ".".join(str(p) for p in err["loc"])
    forms = list(dict.fromkeys(
        e["loc"][1] for e in errors
        if len(e["loc"]) > 1 and e["loc"][0] == err["loc"][0] and isinstance(e["loc"][1], str)))
    if len(forms) > 1:
        return f"{field}: expected one of {', '.join(forms)}; got {body.get(field)!r}", field
    if err["type"] == "extra_forbidden":
        return f"{loc} is not supported by runnerlab serve; remove it", field
    if err["type"] == "missing":
        return f"{loc} is required", field
    return f"{loc}: {err['msg']} (got {err.get('input')!r})", field
