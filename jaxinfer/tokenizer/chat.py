"""Chat templates: a conversation (role/content messages) to one prompt string.

A model's own Jinja template (from its GGUF or Hugging Face folder) runs in a
sandboxed jinja2 environment with the helpers HF templates expect
(``raise_exception``, a ``tojson`` that keeps non-ASCII text). A model without
one gets the built-in template of the family its vocabulary shows: Gemma,
Llama 3 or ChatML. Messages are checked first, so a bad conversation is a
:class:`~jaxinfer.errors.RequestError` naming the message at fault.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxinfer.errors import ModelLoadError, RequestError

_ROLES = ("system", "user", "assistant")

ChatRenderer = Callable[[list[dict[str, str]], bool], str]


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Messages as plain dicts, or a RequestError naming the first bad one."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise RequestError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise RequestError("messages is empty; a conversation needs at least one user message")
    out = [_validate_message(i, m) for i, m in enumerate(messages)]
    for i, m in enumerate(out[1:], start=1):
        if m["role"] == "system":
            raise RequestError(f"messages[{i}] has role 'system'; only the first message may")
    if all(m["role"] == "system" for m in out):
        raise RequestError("messages holds only a system message; add a user message")
    return out


def _validate_message(index: int, message: Any) -> dict[str, str]:
    if not isinstance(message, Mapping):
        raise RequestError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    if role not in _ROLES:
        raise RequestError(f"messages[{index}] has role {role!r}; allowed: {', '.join(_ROLES)}")
    if not isinstance(content, str):
        kind = type(content).__name__
        raise RequestError(f"messages[{index}]['content'] must be a string, got {kind}")
    return {"role": role, "content": content}


def _gemma_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """Gemma's official template: the system prompt opens the first user turn."""
    prefix, turns = "", messages
    if messages[0]["role"] == "system":
        prefix, turns = messages[0]["content"] + "\n\n", messages[1:]
    parts = []
    for i, m in enumerate(turns):
        if (m["role"] == "user") != (i % 2 == 0):
            raise RequestError(
                f"Gemma conversations alternate user/assistant starting with user; "
                f"message {i + len(messages) - len(turns)} has role {m['role']!r}"
            )
        role = "model" if m["role"] == "assistant" else m["role"]
        first = prefix if i == 0 else ""
        parts.append(f"<start_of_turn>{role}\n{first}{m['content'].strip()}<end_of_turn>\n")
    if add_generation_prompt:
        parts.append("<start_of_turn>model\n")
    return "".join(parts)


def _llama3_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    parts = [
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
        for m in messages
    ]
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def _chatml_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


# family -> (a token only that family's vocabulary has, its template)
_BUILTIN_CHAT: dict[str, tuple[str, ChatRenderer]] = {
    "gemma": ("<start_of_turn>", _gemma_chat),
    "llama3": ("<|start_header_id|>", _llama3_chat),
    "chatml": ("<|im_start|>", _chatml_chat),
}


def _raise_from_template(message: str) -> None:
    raise RequestError(f"chat template rejected the conversation: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def compile_template(template: str) -> jinja2.Template:
    """A model's Jinja chat template, compiled once when the tokenizer is built."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_from_template
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except jinja2.TemplateError as err:
        raise ModelLoadError(f"the chat template does not parse: {err}") from err


def render_template(
    template: jinja2.Template,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
    *,
    bos_token: str,
    eos_token: str,
    pad_token: str,
) -> str:
    """The prompt ``template`` writes for ``messages`` (special tokens as text, "" if none)."""
    try:
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
        )
    except jinja2.TemplateError as err:
        raise RequestError(f"the chat template failed on this conversation: {err}") from err


def builtin_template(piece_to_id: Callable[[str], int | None]) -> ChatRenderer:
    """The built-in template whose marker token the vocabulary (``piece_to_id``) has."""
    for marker, render in _BUILTIN_CHAT.values():
        if piece_to_id(marker) is not None:
            return render
    raise RequestError(
        "this model has no chat template, and its vocabulary fits none of "
        f"the built-in ones ({', '.join(_BUILTIN_CHAT)}); send a plain prompt"
    )
