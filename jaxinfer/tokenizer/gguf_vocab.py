"""A tokenizer from a GGUF's ``tokenizer.ggml.*`` metadata.

``tokenizer.ggml.model`` says which kind:

* ``llama``: llama.cpp stores a sentencepiece vocabulary as parallel arrays
  (pieces, scores, piece types) plus special-token ids. They are rebuilt here into
  an in-memory sentencepiece ``ModelProto`` (BPE, no normalization but spaces to
  ``▁``), with Gemma's quirks undone so ids match Hugging Face's tokenizer.
* ``gpt2``: byte-level BPE (Llama 3, Qwen2, SmolLM): tokens, merges and the
  ``tokenizer.ggml.pre`` split become a ``tokenizers.Tokenizer`` (``gguf_bpe``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sentencepiece import sentencepiece_model_pb2 as spm_pb2

from jaxinfer.errors import ModelLoadError
from jaxinfer.gguf_file import read_gguf
from jaxinfer.tokenizer.backends import SentencePieceBackend, TokenizersBackend
from jaxinfer.tokenizer.common import (
    BYTE,
    BYTE_PIECE,
    NORMAL,
    UNKNOWN,
    TokenizerParts,
    id_list,
)
from jaxinfer.tokenizer.gguf_bpe import byte_level_bpe, pre_tokenizer_for

_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def gguf_parts(source: str | os.PathLike[str] | Any) -> TokenizerParts:
    """The tokenizer stored in a GGUF (a path, a parsed file, or its metadata mapping)."""
    meta = _gguf_metadata(source)
    model = _require(meta, "tokenizer.ggml.model")
    if model == "gpt2":
        return _bpe_parts(meta, _where(source))
    if model != "llama":
        raise ModelLoadError(
            f"GGUF tokenizer model {model!r} is not supported; only 'llama' (sentencepiece) "
            "and 'gpt2' (byte-level BPE) are. "
            "Use the model's Hugging Face folder (tokenizer.json) instead."
        )
    proto = _gguf_to_proto(meta)
    spec = proto.trainer_spec
    return TokenizerParts(
        SentencePieceBackend(proto),
        bos_id=spec.bos_id if spec.bos_id >= 0 else None,
        eos_id=spec.eos_id if spec.eos_id >= 0 else None,
        pad_id=spec.pad_id if spec.pad_id >= 0 else None,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        stop_token_ids=_extra_stop_ids(meta),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _bpe_parts(meta: Mapping[str, Any], where: str) -> TokenizerParts:
    """A ``gpt2`` (byte-level BPE) tokenizer, ids and flags read as llama.cpp reads them."""
    if "tokenizer.ggml.merges" not in meta:  # first: without merges nothing else matters
        raise ModelLoadError(
            f"{where}: a 'gpt2' (byte-level BPE) tokenizer needs 'tokenizer.ggml.merges', "
            "and this file has none"
        )
    # llama.cpp reads a file written before tokenizer.ggml.pre existed as 'default'
    pre = pre_tokenizer_for(str(meta.get("tokenizer.ggml.pre") or "default"), where)
    tokens, _, types = _gguf_pieces(meta)
    merges = list(meta["tokenizer.ggml.merges"])
    backend = TokenizersBackend(byte_level_bpe(tokens, types, merges, pre, where))
    n = len(tokens)
    ids = {
        name: _optional_id(meta, f"tokenizer.ggml.{name}_token_id", n)
        for name in ("bos", "eos", "padding")
    }
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    return TokenizerParts(
        backend,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["padding"],
        add_bos=pre.add_bos if add_bos is None else bool(add_bos),
        stop_token_ids=_extra_stop_ids(meta),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _extra_stop_ids(meta: Mapping[str, Any]) -> list[int]:
    """End-of-turn and end-of-message ids, stops besides eos."""
    return [
        *id_list(_list_or_int(meta.get("tokenizer.ggml.eot_token_id"))),
        *id_list(_list_or_int(meta.get("tokenizer.ggml.eom_token_id"))),
    ]


def _where(source: Any) -> str:
    """The file a message names, or 'GGUF' for metadata given directly."""
    return os.fspath(source) if isinstance(source, str | os.PathLike) else "GGUF"


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
    bad = sorted({t for t in types if not NORMAL <= t <= BYTE})
    if bad:
        raise ModelLoadError(f"GGUF tokenizer.ggml.token_type holds unknown types {bad} (1..6)")
    return tokens, scores, types


def _guess_type(piece: str) -> int:
    return BYTE if BYTE_PIECE.fullmatch(piece) else NORMAL


def _gemma_fixups(pieces: list[str], scores: list[float], types: list[int]) -> None:
    """Gemma GGUFs store runs of spaces as real spaces, and merge in file order.

    Respell those pieces with ``▁`` and make them normal BPE pieces, and rank every
    piece by its position, as Hugging Face does for these files; otherwise runs of
    more than 31 spaces split differently.
    """
    for i, piece in enumerate(pieces):
        if piece and not piece.strip(" "):
            pieces[i], types[i] = "▁" * len(piece), NORMAL
        scores[i] = float(-i)


def _gguf_to_proto(meta: Mapping[str, Any]) -> spm_pb2.ModelProto:
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
        ids["unk"] = next((i for i, t in enumerate(types) if t == UNKNOWN), None)
    if ids["unk"] is None:
        raise ModelLoadError(
            "GGUF tokenizer has no unknown token (tokenizer.ggml.unknown_token_id)"
        )
    types[ids["unk"]] = UNKNOWN
    proto = spm_pb2.ModelProto()
    for piece, score, kind in zip(pieces, scores, types, strict=True):
        proto.pieces.add(piece=piece, score=score, type=kind)
    _fill_trainer_spec(proto, ids, byte_fallback=_has_all_bytes(pieces, types))
    _fill_normalizer_spec(proto, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    return proto


def _has_all_bytes(pieces: Sequence[str], types: Sequence[int]) -> bool:
    pairs = zip(pieces, types, strict=True)
    found = {p for p, t in pairs if t == BYTE and BYTE_PIECE.fullmatch(p)}
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
