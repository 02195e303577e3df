"""Text to token ids and back, and token ids to streamed text.

Every model jaxinfer serves comes with one of two kinds of tokenizer:

* **sentencepiece** (Gemma, Llama 2, Mistral). The ``ModelProto`` is read from a
  ``tokenizer.model`` or rebuilt in memory from a GGUF's ``tokenizer.ggml.*``
  metadata. Encoding runs in sentencepiece's C++ BPE; decoding is done here and
  follows Hugging Face's decoder chain (``▁`` becomes a space, byte pieces are
  fused into UTF-8), so ids and text agree with ``transformers`` token for token.
* **tokenizer.json** (Llama 3, Qwen2 byte-level BPE), through the ``tokenizers``
  package.

Special and added tokens (``<start_of_turn>``, ``<|im_end|>``, ``\\n``) are found
whole in the text before the model sees it, leftmost-longest, as HF does.

:class:`IncrementalDetokenizer` turns the decode loop's one-token-at-a-time
output into text deltas. Like vLLM it re-decodes only a short window of recent
tokens (a prefix offset and a read offset), and it holds back the bytes of a
character that is not complete yet, so a stream never shows half an emoji.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import sentencepiece as spm
import tokenizers
from sentencepiece import sentencepiece_model_pb2 as spm_pb2

from jaxinfer.errors import ModelLoadError, RequestError
from jaxinfer.gguf_file import read_gguf

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

META_FILE = "tokenizer_meta.json"
_META_VERSION = 1
_SPM_FILE = "tokenizer.model"
_JSON_FILE = "tokenizer.json"

# sentencepiece piece types; GGUF's tokenizer.ggml.token_type uses the same numbers.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Tokens that end a chat turn, besides eos, in the vocabularies we know.
_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>")
_ROLES = ("system", "user", "assistant")
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
_REPLACE_PER_BYTE = "jaxinfer.replace_per_byte"
# Prompt tokens kept as decode context by the detokenizer (vLLM uses the same 5).
_CONTEXT_TOKENS = 5


def _replace_per_byte(err: UnicodeError) -> tuple[str, int]:
    """One U+FFFD per undecodable byte, as HF's ByteFallback and sentencepiece do."""
    assert isinstance(err, UnicodeDecodeError)
    return "\ufffd" * (err.end - err.start), err.end


codecs.register_error(_REPLACE_PER_BYTE, _replace_per_byte)


def _utf8(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", _REPLACE_PER_BYTE)


def _incomplete_utf8_tail(data: bytes) -> bool:
    """Whether ``data`` ends inside a UTF-8 character that more bytes could still complete."""
    for k in range(1, min(3, len(data)) + 1):
        lead = data[-k]
        if lead < 0x80:
            return False
        if lead >= 0xC0:
            try:
                data[-k:].decode("utf-8")
            except UnicodeDecodeError as err:
                return err.reason == "unexpected end of data" and err.start == 0
            return False
    return False


# ---------------------------------------------------------------------------
# GGUF metadata -> sentencepiece ModelProto
# ---------------------------------------------------------------------------


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"GGUF metadata has no {key!r}; the file carries no usable tokenizer")
    return meta[key]


def _optional_id(meta: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    value = int(np.asarray(value).reshape(-1)[0])
    if not 0 <= value < vocab_size:
        raise ModelLoadError(f"GGUF {key}={value} is outside the vocabulary (size {vocab_size})")
    return value


def _gguf_pieces(meta: Mapping[str, Any]) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, types) from the metadata, checked to be the same length."""
    tokens = list(_require(meta, "tokenizer.ggml.tokens"))
    n = len(tokens)
    scores = meta.get("tokenizer.ggml.scores")
    scores = [float(-i) for i in range(n)] if scores is None else [float(s) for s in scores]
    types = meta.get("tokenizer.ggml.token_type")
    types = [_guess_type(t) for t in tokens] if types is None else [int(t) for t in types]
    for key, values in (("scores", scores), ("token_type", types)):
        if len(values) != n:
            raise ModelLoadError(f"GGUF tokenizer.ggml.{key} has {len(values)} entries, tokens {n}")
    bad = sorted({t for t in types if not _NORMAL <= t <= _BYTE})
    if bad:
        raise ModelLoadError(f"GGUF tokenizer.ggml.token_type holds unknown types {bad} (1..6)")
    return tokens, scores, types


def _guess_type(piece: str) -> int:
    return _BYTE if _BYTE_PIECE.fullmatch(piece) else _NORMAL


def _gemma_fixups(pieces: list[str], scores: list[float], types: list[int]) -> None:
    """Gemma GGUFs store runs of spaces as real spaces, and merge in file order.

    Respell those pieces with ``▁`` and make them normal BPE pieces, and rank every
    piece by its position, as Hugging Face does for these files; otherwise runs of
    more than 31 spaces split differently.
    """
    for i, piece in enumerate(pieces):
        if piece and not piece.strip(" "):
            pieces[i], types[i] = "▁" * len(piece), _NORMAL
        scores[i] = float(-i)


def _gguf_to_proto(meta: Mapping[str, Any]) -> spm_pb2.ModelProto:
    model = _require(meta, "tokenizer.ggml.model")
    if model != "llama":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported; only 'llama' (sentencepiece) is. "
            "Use the model's Hugging Face folder (tokenizer.json) instead."
        )
    pieces, scores, types = _gguf_pieces(meta)
    if meta.get("general.architecture") in _GEMMA_ARCHS:
        _gemma_fixups(pieces, scores, types)
    n = len(pieces)
    ids = {
        name: _optional_id(meta, f"tokenizer.ggml.{key}", n)
        for name, key in (
            ("unk", "unknown_token_id"),
            ("bos", "bos_token_id"),
            ("eos", "eos_token_id"),
            ("pad", "padding_token_id"),
        )
    }
    if ids["unk"] is None:
        ids["unk"] = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    if ids["unk"] is None:
        raise ModelLoadError(
            "GGUF tokenizer has no unknown token (tokenizer.ggml.unknown_token_id)"
        )
    types[ids["unk"]] = _UNKNOWN
    proto = spm_pb2.ModelProto()
    for piece, score, kind in zip(pieces, scores, types, strict=True):
        proto.pieces.add(piece=piece, score=score, type=kind)
    _fill_trainer_spec(proto, ids, byte_fallback=_has_all_bytes(pieces, types))
    _fill_normalizer_spec(proto, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    return proto


def _has_all_bytes(pieces: Sequence[str], types: Sequence[int]) -> bool:
    pairs = zip(pieces, types, strict=True)
    found = {p for p, t in pairs if t == _BYTE and _BYTE_PIECE.fullmatch(p)}
    return len(found) == 256


def _fill_trainer_spec(
    proto: spm_pb2.ModelProto, ids: Mapping[str, int | None], *, byte_fallback: bool
) -> None:
    spec = proto.trainer_spec
    spec.model_type = spm_pb2.TrainerSpec.BPE
    spec.vocab_size = len(proto.pieces)
    spec.byte_fallback = byte_fallback
    for name, token_id in ids.items():
        setattr(spec, f"{name}_id", -1 if token_id is None else token_id)
        if token_id is not None:
            setattr(spec, f"{name}_piece", proto.pieces[token_id].piece)


def _fill_normalizer_spec(proto: spm_pb2.ModelProto, add_space_prefix: bool) -> None:
    """No Unicode normalization and no whitespace squeezing: only spaces become ``▁``."""
    spec = proto.normalizer_spec
    spec.name = "identity"
    spec.add_dummy_prefix = add_space_prefix
    spec.remove_extra_whitespaces = False
    spec.escape_whitespaces = True


# ---------------------------------------------------------------------------
# Backends: the two tokenizer kinds behind one small interface
# ---------------------------------------------------------------------------


class _Backend(Protocol):
    kind: str
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...  # no BOS; special tokens parsed
    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...
    def id_to_piece(self, token_id: int) -> str: ...
    def piece_to_id(self, piece: str) -> int | None: ...
    def token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes: ...
    def save(self, directory: Path) -> dict[str, Any]: ...


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


class _SentencePieceBackend:
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
            if t == _BYTE and (m := _BYTE_PIECE.fullmatch(pieces[i]))
        }
        self._special = {i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)}
        whole = (_CONTROL, _UNKNOWN, _USER_DEFINED)  # matched whole in the text
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
        (directory / _SPM_FILE).write_bytes(self.proto.SerializeToString())
        added = [[text, i, special] for text, (i, special) in sorted(self.added.items())]
        return {"added_tokens": added}

    @classmethod
    def load(cls, directory: Path, meta: Mapping[str, Any]) -> _SentencePieceBackend:
        added = {text: (int(i), bool(special)) for text, i, special in meta.get("added_tokens", [])}
        return cls(_read_proto(directory / _SPM_FILE), added)


def _read_proto(path: Path) -> spm_pb2.ModelProto:
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


class _TokenizersBackend:
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
        m = _BYTE_PIECE.fullmatch(piece)
        return bytes([int(m[1], 16)]) if m else piece.replace("▁", " ").encode()

    def prepends(self, token_id: int) -> bool:
        """Whether the post-processor puts ``token_id`` in front of an encoded text."""
        return self._tk.encode("a", add_special_tokens=True).ids[:1] == [token_id]

    def save(self, directory: Path) -> dict[str, Any]:
        (directory / _JSON_FILE).write_text(self._tk.to_str(), encoding="utf-8")
        return {}

    @classmethod
    def load(cls, directory: Path, meta: Mapping[str, Any]) -> _TokenizersBackend:
        del meta
        return cls(_read_tokenizer_json(directory / _JSON_FILE))


def _decoder_types(decoder: Mapping[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    nested = decoder.get("decoders") or []
    return {decoder.get("type", ""), *(t for d in nested for t in _decoder_types(d))}


def _read_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise ModelLoadError(f"tokenizer.json not found: {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exception subclasses
        raise ModelLoadError(f"{path} is not a valid tokenizer.json: {err}") from err


_BACKENDS: dict[str, Any] = {
    "sentencepiece": _SentencePieceBackend,
    "tokenizers": _TokenizersBackend,
}


# ---------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------


def _validate_messages(messages: Any) -> list[dict[str, str]]:
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
_BUILTIN_CHAT: dict[str, tuple[str, Callable[[list[dict[str, str]], bool], str]]] = {
    "gemma": ("<start_of_turn>", _gemma_chat),
    "llama3": ("<|start_header_id|>", _llama3_chat),
    "chatml": ("<|im_start|>", _chatml_chat),
}


def _raise_from_template(message: str) -> None:
    raise RequestError(f"chat template rejected the conversation: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _compile_jinja(template: str) -> Any | None:
    """The compiled template, or None when jinja2 is not installed."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_from_template
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except jinja2.TemplateError as err:
        raise ModelLoadError(f"the chat template does not parse: {err}") from err


# ---------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _hf_added_tokens(tok_cfg: Mapping[str, Any]) -> dict[str, tuple[int, bool]]:
    decoder = tok_cfg.get("added_tokens_decoder") or {}
    return {
        entry["content"]: (int(i), bool(entry.get("special", False)))
        for i, entry in decoder.items()
        if isinstance(entry, Mapping) and "content" in entry
    }


def _hf_backend(directory: Path, tok_cfg: Mapping[str, Any]) -> _Backend:
    if (directory / _SPM_FILE).is_file():
        proto = _read_proto(directory / _SPM_FILE)
        added = _hf_added_tokens(tok_cfg)
        pieces = {p.piece: i for i, p in enumerate(proto.pieces)}
        # keep only what the proto does not already say
        extra = {t: v for t, v in added.items() if pieces.get(t) != v[0] or v[1]}
        return _SentencePieceBackend(proto, extra)
    if (directory / _JSON_FILE).is_file():
        return _TokenizersBackend(_read_tokenizer_json(directory / _JSON_FILE))
    raise ModelLoadError(f"{directory} has neither {_SPM_FILE} nor {_JSON_FILE}")


def _hf_special_id(
    backend: _Backend, tok_cfg: Mapping[str, Any], name: str, fallbacks: Iterable[Any]
) -> int | None:
    """The id of ``{name}_token``: tokenizer_config.json first (null means none), then configs."""
    key = f"{name}_token"
    if key in tok_cfg:
        text = _token_text(tok_cfg[key])
        token_id = None if text is None else backend.piece_to_id(text)
        if text is not None and token_id is None:
            raise ModelLoadError(f"tokenizer_config.json {key}={text!r} is not in the vocabulary")
        return token_id
    for value in fallbacks:
        ids = _id_list(value)
        if ids:
            return ids[0]
    return None


def _hf_chat_template(directory: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _proto_id(backend: _Backend, name: str) -> int | None:
    if not isinstance(backend, _SentencePieceBackend):
        return None
    token_id = getattr(backend.proto.trainer_spec, f"{name}_id")
    return token_id if 0 <= token_id < backend.vocab_size else None


def _detect_add_bos(backend: _Backend, bos_id: int | None) -> bool:
    """Whether HF would prepend BOS: its post-processor does it for tokenizer.json models."""
    if bos_id is None:
        return False
    if not isinstance(backend, _TokenizersBackend):
        return True
    return backend.prepends(bos_id)


# ---------------------------------------------------------------------------
# The public tokenizer
# ---------------------------------------------------------------------------


class Tokenizer:
    """Encodes prompts, decodes outputs, and formats chats for one model.

    Build one with :meth:`from_gguf`, :meth:`from_hf_dir` or :meth:`load`.
    """

    def __init__(
        self,
        backend: _Backend,
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
        self._jinja = _compile_jinja(chat_template) if chat_template else None

    def _collect_stop_ids(self, extra: Iterable[int]) -> tuple[int, ...]:
        found = [self.piece_to_id(piece) for piece in _END_OF_TURN]
        ids = [self._eos_id, *extra, *found]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    # -- constructors -------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike[str] | Any) -> Tokenizer:
        """The tokenizer stored in a GGUF's metadata (``tokenizer.ggml.model == 'llama'``).

        Accepts a path, an object with a ``metadata`` mapping
        (a parsed GGUF file) or the metadata mapping itself.
        """
        meta = _gguf_metadata(path_or_reader)
        proto = _gguf_to_proto(meta)
        backend = _SentencePieceBackend(proto)
        spec = proto.trainer_spec
        extra = [
            *_id_list(_list_or_int(meta.get("tokenizer.ggml.eot_token_id"))),
            *_id_list(_list_or_int(meta.get("tokenizer.ggml.eom_token_id"))),
        ]
        return cls(
            backend,
            bos_id=spec.bos_id if spec.bos_id >= 0 else None,
            eos_id=spec.eos_id if spec.eos_id >= 0 else None,
            pad_id=spec.pad_id if spec.pad_id >= 0 else None,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            stop_token_ids=extra,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face model folder: ``tokenizer.model`` if present, else ``tokenizer.json``."""
        directory = Path(path)
        if not directory.is_dir():
            raise ModelLoadError(f"tokenizer folder not found: {directory}")
        tok_cfg = _read_json(directory / "tokenizer_config.json")
        model_cfg = _read_json(directory / "config.json")
        gen_cfg = _read_json(directory / "generation_config.json")
        backend = _hf_backend(directory, tok_cfg)
        ids = {
            name: _hf_special_id(
                backend,
                tok_cfg,
                name,
                (
                    model_cfg.get(f"{name}_token_id"),
                    gen_cfg.get(f"{name}_token_id"),
                    _proto_id(backend, name),
                ),
            )
            for name in ("bos", "eos", "pad")
        }
        add_bos = tok_cfg.get("add_bos_token")
        return cls(
            backend,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["pad"],
            add_bos=_detect_add_bos(backend, ids["bos"]) if add_bos is None else bool(add_bos),
            stop_token_ids=[
                *_id_list(gen_cfg.get("eos_token_id")),
                *_id_list(model_cfg.get("eos_token_id")),
            ],
            chat_template=_hf_chat_template(directory, tok_cfg),
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
        meta = _read_json(meta_path)
        if meta.get("format_version") != _META_VERSION:
            raise ModelLoadError(
                f"{meta_path}: format_version {meta.get('format_version')!r} "
                f"is not supported (expected {_META_VERSION})"
            )
        backend_cls = _BACKENDS.get(meta.get("backend", ""))
        if backend_cls is None:
            raise ModelLoadError(
                f"{meta_path}: unknown backend {meta.get('backend')!r}; "
                f"expected one of {sorted(_BACKENDS)}"
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

    def _token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        return self._backend.token_bytes(token_id, skip_special_tokens)

    # -- chat -------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for a conversation, without BOS (:meth:`encode` adds it).

        Uses the model's Jinja template when it has one and jinja2 is installed,
        else the built-in template of its family (Gemma, Llama 3 or ChatML).
        """
        checked = _validate_messages(messages)
        if self._jinja is not None:
            return self._render_jinja(checked, add_generation_prompt)
        return self._builtin_chat()(checked, add_generation_prompt)

    def _builtin_chat(self) -> Callable[[list[dict[str, str]], bool], str]:
        for marker, render in _BUILTIN_CHAT.values():
            if self.piece_to_id(marker) is not None:
                return render
        raise RequestError(
            "this model has no chat template, and its vocabulary fits none of "
            f"the built-in ones ({', '.join(_BUILTIN_CHAT)}); send a plain prompt"
        )

    def _render_jinja(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        import jinja2

        bos = self._piece_or_empty(self._bos_id)
        try:
            text = self._jinja.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos,
                eos_token=self._piece_or_empty(self._eos_id),
                pad_token=self._piece_or_empty(self._pad_id),
            )
        except jinja2.TemplateError as err:
            raise RequestError(f"the chat template failed on this conversation: {err}") from err
        # encode() adds BOS itself; a template that writes it would double it
        return text[len(bos) :] if self._add_bos and bos and text.startswith(bos) else text

    def _piece_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else self.id_to_piece(token_id)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self._backend.kind}, vocab_size={self.vocab_size}, "
            f"bos_id={self._bos_id}, eos_id={self._eos_id}, stop_token_ids={self._stop})"
        )


def _list_or_int(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def _gguf_metadata(source: Any) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    if isinstance(getattr(source, "metadata", None), Mapping):  # jaxinfer.weights' GGUFFile
        return source.metadata
    if isinstance(source, str | os.PathLike):
        return read_gguf(source, with_tensors=False).metadata
    raise ModelLoadError(
        f"from_gguf needs a path, a parsed GGUF file or its metadata, got {type(source).__name__}"
    )


# ---------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas.

    Each :meth:`push` decodes only the tokens since the last emitted chunk (plus
    the chunk before it, as context for decoders that strip or merge across
    tokens), so a step costs O(1) in the length of the output. A character whose
    bytes are still arriving is held back until it completes; bytes that can never
    complete come out as U+FFFD, exactly as :meth:`Tokenizer.decode` shows them.
    The deltas concatenate to ``decode(generated_ids)``, with :meth:`flush`
    releasing a trailing incomplete character when the sequence ends.

    ``prompt_ids`` give the first tokens their context: the text is then what the
    generated ids add after the prompt (the same as decoding them alone for
    Gemma and byte-level BPE; a sentencepiece model with a dummy prefix keeps the
    leading space of the first word).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # the window: emitted tokens kept as context, then tokens not emitted yet
        self._ids = [int(i) for i in (prompt_ids or [])][-_CONTEXT_TOKENS:]
        self._read = len(self._ids)  # window tokens before this have been emitted
        self._chunks: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text (possibly empty)."""
        self._ids.append(int(token_id))
        window = self._decode(self._ids)
        if window.endswith("\ufffd") and self._tail_incomplete():
            return ""
        return self._emit(window)

    def flush(self) -> str:
        """Release whatever is held back (call once, when the sequence ends)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _emit(self, window: str) -> str:
        delta = window[len(self._decode(self._ids[: self._read])) :]
        # the tokens just emitted become the next window's context
        del self._ids[: self._read]
        self._read = len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _tail_incomplete(self) -> bool:
        tail = b""
        for token_id in reversed(self._ids[self._read :]):
            tail = self._tok._token_bytes(token_id, self._skip) + tail
            if len(tail) >= 4:
                break
        return _incomplete_utf8_tail(tail)
