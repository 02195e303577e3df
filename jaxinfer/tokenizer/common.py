"""What every part of the tokenizer shares: piece types, file names, the backend
interface, and the parts a :class:`~jaxinfer.tokenizer.Tokenizer` is built from."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jaxinfer.errors import ModelLoadError

SPM_FILE = "tokenizer.model"
JSON_FILE = "tokenizer.json"

# sentencepiece piece types; GGUF's tokenizer.ggml.token_type uses the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Backend(Protocol):
    """One tokenizer kind (sentencepiece or ``tokenizers``) behind one small interface."""

    kind: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...  # no BOS; special tokens parsed
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def id_to_piece(self, token_id: int) -> str: ...
    def piece_to_id(self, piece: str) -> int | None: ...
    def token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes: ...
    def save(self, directory: Path) -> dict[str, Any]: ...


@dataclass(frozen=True)
class TokenizerParts:
    """What a builder (GGUF metadata, a Hugging Face folder) reads: a Tokenizer's arguments."""

    backend: Backend
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool
    stop_token_ids: Sequence[int]
    chat_template: str | None


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def id_list(value: Any) -> list[int]:
    """A token id or a list of them (as configs write eos) as a list; anything else as []."""
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []
