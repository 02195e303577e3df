"""The two tokenizer kinds behind one interface (:class:`~.common.Backend`).

* :class:`SentencePieceBackend` encodes in sentencepiece's C++ BPE and decodes
  here, following Hugging Face's decoder chain (``▁`` becomes a space, byte
  pieces are fused into UTF-8), so ids and text agree with ``transformers``.
  Added and special tokens are found whole in the text first, leftmost-longest.
* :class:`TokenizersBackend` runs a ``tokenizer.json`` (byte-level BPE and
  others) through the ``tokenizers`` package.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as spm_pb2

from jaxinfer.errors import ModelLoadError, RequestError
from jaxinfer.tokenizer.common import (
    BYTE,
    BYTE_PIECE,
    CONTROL,
    JSON_FILE,
    SPM_FILE,
    UNKNOWN,
    USER_DEFINED,
)

_REPLACE_PER_BYTE = "jaxinfer.replace_per_byte"


def _replace_per_byte(err: UnicodeError) -> tuple[str, int]:
    """One U+FFFD per undecodable byte, as HF's ByteFallback and sentencepiece do."""
    assert isinstance(err, UnicodeDecodeError)
    return "\ufffd" * (err.end - err.start), err.end


codecs.register_error(_REPLACE_PER_BYTE, _replace_per_byte)


def _utf8(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", _REPLACE_PER_BYTE)


class _AddedTokenMatcher:
    """Finds added tokens in raw text, leftmost-longest, as HF's added vocabulary does."""

    def __init__(self, tokens: Mapping[str, int]) -> None:
        self._ids = {text: i for text, i in tokens.items() if text}
        lengths: dict[str, set[int]] = {}
        for text in self._ids:
            lengths.setdefault(text[0], set()).add(len(text))
        self._lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        chars = "".join(re.escape(c) for c in self._lengths)
        self._starts = re.compile(f"[{chars}]") if chars else None

    def split(self, text: str) -> list[str | int]:
        """The text as plain runs (str) and added-token ids (int), in order."""
        parts: list[str | int] = []
        pos = 0
        for m in self._starts.finditer(text) if self._starts else ():
            start = m.start()
            if start < pos:
                continue
            token_id, end = self._match_at(text, start)
            if token_id is None:
                continue
            if start > pos:
                parts.append(text[pos:start])
            parts.append(token_id)
            pos = end
        if pos < len(text):
            parts.append(text[pos:])
        return parts

    def _match_at(self, text: str, start: int) -> tuple[int | None, int]:
        for length in self._lengths[text[start]]:
            token_id = self._ids.get(text[start : start + length])
            if token_id is not None:
                return token_id, start + length
        return None, start


class SentencePieceBackend:
    """sentencepiece BPE/unigram for encoding; HF-compatible decoding in Python.

    ``added`` maps token text to ``(id, special)`` for tokens a tokenizer_config
    declares on top of the proto (they may rename a piece or extend the vocabulary).
    """

    kind = "sentencepiece"

    def __init__(
        self, proto: spm_pb2.ModelProto, added: Mapping[str, tuple[int, bool]] | None = None
    ) -> None:
        self.proto = proto
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(proto.SerializeToString())
        except (RuntimeError, OSError) as err:
            raise ModelLoadError(f"sentencepiece rejected the tokenizer model: {err}") from err
        self.added = dict(added or {})
        self._build_tables()
        self._strip_leading_space = proto.normalizer_spec.add_dummy_prefix

    def _build_tables(self) -> None:
        pieces = [p.piece for p in self.proto.pieces]
        types = [p.type for p in self.proto.pieces]
        self._pieces = pieces
        self._texts = [p.replace("▁", " ") for p in pieces]
        self._bytes = {
            i: int(m[1], 16)
            for i, t in enumerate(types)
            if t == BYTE and (m := BYTE_PIECE.fullmatch(pieces[i]))
        }
        self._special = {i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)}
        whole = (CONTROL, UNKNOWN, USER_DEFINED)  # matched whole in the text
        matched = {pieces[i]: i for i, t in enumerate(types) if t in whole}
        for text, (token_id, special) in self.added.items():
            self._add_token(text, token_id, special)
            matched[text] = token_id
        self._piece_ids = {p: i for i, p in enumerate(self._pieces)}
        self._matcher = _AddedTokenMatcher(matched)

    def _add_token(self, text: str, token_id: int, special: bool) -> None:
        missing = token_id + 1 - len(self._pieces)
        if missing > 0:
            self._pieces += [""] * missing
            self._texts += [""] * missing
        self._pieces[token_id] = self._texts[token_id] = text
        self._bytes.pop(token_id, None)
        if special:
            self._special.add(token_id)

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self._matcher.split(text):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(self._sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        out: list[str] = []
        pending = bytearray()  # a run of byte pieces, decoded together
        for i in ids:
            byte = self._bytes.get(i)
            if byte is not None:
                pending.append(byte)
            elif not (skip_special_tokens and i in self._special):
                if pending:
                    out.append(_utf8(pending))
                    pending.clear()
                out.append(self._texts[i])
        out.append(_utf8(pending))
        text = "".join(out)
        return text[1:] if self._strip_leading_space and text.startswith(" ") else text

    def id_to_piece(self, token_id: int) -> str:
        return self._pieces[token_id]

    def piece_to_id(self, piece: str) -> int | None:
        return self._piece_ids.get(piece)

    def token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        byte = self._bytes.get(token_id)
        if byte is not None:
            return bytes([byte])
        if skip_special_tokens and token_id in self._special:
            return b""
        return self._texts[token_id].encode()

    def save(self, directory: Path) -> dict[str, Any]:
        (directory / SPM_FILE).write_bytes(self.proto.SerializeToString())
        added = [[text, i, special] for text, (i, special) in sorted(self.added.items())]
        return {"added_tokens": added}

    @classmethod
    def load(cls, directory: Path, meta: Mapping[str, Any]) -> SentencePieceBackend:
        added = {text: (int(i), bool(special)) for text, i, special in meta.get("added_tokens", [])}
        return cls(read_proto(directory / SPM_FILE), added)


def read_proto(path: Path) -> spm_pb2.ModelProto:
    proto = spm_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except FileNotFoundError as err:
        raise ModelLoadError(f"sentencepiece model not found: {path}") from err
    except Exception as err:  # protobuf raises its own DecodeError
        raise ModelLoadError(f"{path} is not a sentencepiece model: {err}") from err
    if not proto.pieces:
        raise ModelLoadError(f"{path} holds no sentencepiece pieces")
    return proto


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = [b for b in range(256) if b not in keep]
    chars = {b: chr(b) for b in keep}
    chars.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return chars


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenizersBackend:
    """A ``tokenizer.json`` through the ``tokenizers`` package (byte-level BPE and others)."""

    kind = "tokenizers"

    def __init__(self, tk: tokenizers.Tokenizer) -> None:
        self._tk = tk
        added = tk.get_added_tokens_decoder()
        self._special = {i for i, token in added.items() if token.special}
        self._byte_level = "ByteLevel" in _decoder_types(json.loads(tk.to_str()).get("decoder"))

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tk.id_to_token(token_id)
        if piece is None:
            raise RequestError(f"token id {token_id} has no piece in this vocabulary")
        return piece

    def piece_to_id(self, piece: str) -> int | None:
        return self._tk.token_to_id(piece)

    def token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        if skip_special_tokens and token_id in self._special:
            return b""
        piece = self.id_to_piece(token_id)
        if self._byte_level and set(piece) <= _UNICODE_TO_BYTE.keys():
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        m = BYTE_PIECE.fullmatch(piece)
        return bytes([int(m[1], 16)]) if m else piece.replace("▁", " ").encode()

    def prepends(self, token_id: int) -> bool:
        """Whether the post-processor puts ``token_id`` in front of an encoded text."""
        return self._tk.encode("a", add_special_tokens=True).ids[:1] == [token_id]

    def save(self, directory: Path) -> dict[str, Any]:
        (directory / JSON_FILE).write_text(self._tk.to_str(), encoding="utf-8")
        return {}

    @classmethod
    def load(cls, directory: Path, meta: Mapping[str, Any]) -> TokenizersBackend:
        del meta
        return cls(read_tokenizer_json(directory / JSON_FILE))


def _decoder_types(decoder: Mapping[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    nested = decoder.get("decoders") or []
    return {decoder.get("type", ""), *(t for d in nested for t in _decoder_types(d))}


def read_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ModelLoadError(f"tokenizer.json not found: {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exception subclasses
        raise ModelLoadError(f"{path} is not a valid tokenizer.json: {err}") from err


BACKENDS: dict[str, Any] = {
    "sentencepiece": SentencePieceBackend,
    "tokenizers": TokenizersBackend,
}
