"""Conversations through a model's chat template (LLM.chat, `generate --chat`, the
server's /v1/chat/completions): one function, so all three give the same token ids."""

from __future__ import annotations

from typing import Any

from shared.serving.admission import EngineInputError

Conversation = list[dict[str, str]]


class ChatTemplateError(EngineInputError):
    """The model cannot take a conversation (no tokenizer, or no chat template)."""


def chat_prompt_token_ids(tokenizer: Any, conversation: Conversation,
                          add_generation_prompt: bool = True) -> list[int]:
    """A conversation ([{"role", "content"}, ...]) as token ids.

    Tokenized by the template itself: the template already writes any BOS it wants, and
    encoding its text again would add a second one with a tokenizer that adds BOS. The
    return type moved across transformers releases (a list of ids; in 5.x a dict-like
    BatchEncoding by default), so every form is accepted.
    """
    if tokenizer is None:
        raise ChatTemplateError("a chat needs a model with a tokenizer and a chat template; "
                                "this model has no tokenizer: pass token ids instead")
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the model's tokenizer has no chat template; send a plain "
                                "prompt (completions) instead")
    out = tokenizer.apply_chat_template(conversation, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        out = out[0]
    return [int(t) for t in out]
