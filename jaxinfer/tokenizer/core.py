"""The public :class:`Tokenizer`, and the folder format it saves to and loads from."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from jaxinfer.errors import ModelLoadError, RequestError
from jaxinfer.tokenizer.backends import BACKENDS
from jaxinfer.tokenizer.chat import (
    builtin_template,
    compile_template,
    render_template,
    validate_messages,
)
from jaxinfer.tokenizer.common import Backend, TokenizerParts, read_json
from jaxinfer.tokenizer.gguf_vocab import gguf_parts
from jaxinfer.tokenizer.hf_folder import hf_parts

META_FILE = "tokenizer_meta.json"
_META_VERSION = 1
# Tokens that end a chat turn, besides eos, in the vocabularies we know.
_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>")


class Tokenizer:
    """Encodes prompts, decodes outputs, and formats chats for one model.

    Build one with :meth:`from_gguf`, :meth:`from_hf_dir` or :meth:`load`.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        add_bos: bool,
        stop_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._bos_id, self._eos_id, self._pad_id = bos_id, eos_id, pad_id
        self._add_bos = add_bos and bos_id is not None
        self._stop = self._collect_stop_ids(stop_token_ids)
        self._chat_template = chat_template
        self._jinja = compile_template(chat_template) if chat_template else None

    def _collect_stop_ids(self, extra: Iterable[int]) -> tuple[int, ...]:
        found = [self.piece_to_id(piece) for piece in _END_OF_TURN]
        ids = [self._eos_id, *extra, *found]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    # -- constructors -------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike[str] | Any) -> Tokenizer:
        """The tokenizer stored in a GGUF's metadata (``tokenizer.ggml.model`` 'llama' or 'gpt2').

        Accepts a path, an object with a ``metadata`` mapping
        (a parsed GGUF file) or the metadata mapping itself.
        """
        return cls._from_parts(gguf_parts(path_or_reader))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face model folder: ``tokenizer.model`` if present, else ``tokenizer.json``."""
        return cls._from_parts(hf_parts(path))

    @classmethod
    def _from_parts(cls, parts: TokenizerParts) -> Tokenizer:
        return cls(
            parts.backend,
            bos_id=parts.bos_id,
            eos_id=parts.eos_id,
            pad_id=parts.pad_id,
            add_bos=parts.add_bos,
            stop_token_ids=parts.stop_token_ids,
            chat_template=parts.chat_template,
        )

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """A tokenizer written by :meth:`save` (inside a converted checkpoint folder)."""
        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.is_file():
            raise ModelLoadError(
                f"{meta_path} not found; use Tokenizer.from_hf_dir for a Hugging Face folder"
            )
        meta = read_json(meta_path)
        if meta.get("format_version") != _META_VERSION:
            raise ModelLoadError(
                f"{meta_path}: format_version {meta.get('format_version')!r} "
                f"is not supported (expected {_META_VERSION})"
            )
        backend_cls = BACKENDS.get(meta.get("backend", ""))
        if backend_cls is None:
            raise ModelLoadError(
                f"{meta_path}: unknown backend {meta.get('backend')!r}; "
                f"expected one of {sorted(BACKENDS)}"
            )
        return cls(
            backend_cls.load(directory, meta),
            bos_id=meta.get("bos_id"),
            eos_id=meta.get("eos_id"),
            pad_id=meta.get("pad_id"),
            add_bos=bool(meta.get("add_bos", False)),
            stop_token_ids=meta.get("stop_token_ids", []),
            chat_template=meta.get("chat_template"),
        )

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.model`` or ``tokenizer.json`` plus ``tokenizer_meta.json``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            "format_version": _META_VERSION,
            "backend": self._backend.kind,
            "bos_id": self._bos_id,
            "eos_id": self._eos_id,
            "pad_id": self._pad_id,
            "add_bos": self._add_bos,
            "stop_token_ids": list(self._stop),
            "chat_template": self._chat_template,
            **self._backend.save(directory),
        }
        text = json.dumps(meta, indent=2, ensure_ascii=False)
        (directory / META_FILE).write_text(text + "\n", encoding="utf-8")
        return directory

    # -- properties ----------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def add_bos(self) -> bool:
        """Whether :meth:`encode` prepends BOS when asked to (the model wants one)."""
        return self._add_bos

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """eos, then the end-of-turn tokens this vocabulary has."""
        return self._stop

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template the model ships, if any."""
        return self._chat_template

    # -- text <-> ids ----------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids for ``text``; special tokens written in it become single tokens."""
        if not isinstance(text, str):
            raise RequestError(f"text to encode must be a str, got {type(text).__name__}")
        ids = self._backend.encode(text)
        return [self._bos_id, *ids] if add_bos and self._add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``; bytes of an incomplete character come out as U+FFFD."""
        return self._backend.decode(self._checked(ids), skip_special_tokens)

    def _checked(self, ids: Iterable[int]) -> list[int]:
        out = [int(i) for i in ids]
        n = self.vocab_size
        for i in out:
            if not 0 <= i < n:
                raise RequestError(f"token id {i} is out of range; vocab_size is {n}")
        return out

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry for ``token_id`` (``▁`` for a space)."""
        (token_id,) = self._checked([token_id])
        return self._backend.id_to_piece(token_id)

    def piece_to_id(self, piece: str) -> int | None:
        """The id of vocabulary entry ``piece``, or None if it has none."""
        return self._backend.piece_to_id(piece)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """The UTF-8 bytes ``token_id`` adds to decoded text (one byte for a byte piece)."""
        (token_id,) = self._checked([token_id])
        return self._backend.token_bytes(token_id, skip_special_tokens)

    # -- chat -------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for a conversation, without BOS (:meth:`encode` adds it).

        Uses the model's Jinja template when it has one, else
        the built-in template of its family (Gemma, Llama 3 or ChatML).
        """
        checked = validate_messages(messages)
        if self._jinja is not None:
            return self._render_jinja(checked, add_generation_prompt)
        return builtin_template(self.piece_to_id)(checked, add_generation_prompt)

    def _render_jinja(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        bos = self._piece_or_empty(self._bos_id)
        text = render_template(
            self._jinja,
            messages,
            add_generation_prompt,
            bos_token=bos,
            eos_token=self._piece_or_empty(self._eos_id),
            pad_token=self._piece_or_empty(self._pad_id),
        )
        # encode() adds BOS itself; a template that writes it would double it
        return text[len(bos) :] if self._add_bos and bos and text.startswith(bos) else text

    def _piece_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else self.id_to_piece(token_id)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self._backend.kind}, vocab_size={self.vocab_size}, "
            f"bos_id={self._bos_id}, eos_id={self._eos_id}, stop_token_ids={self._stop})"
        )
