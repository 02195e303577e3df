"""A tokenizer from a Hugging Face model folder.

The vocabulary is ``tokenizer.model`` (sentencepiece) when the folder has one,
else ``tokenizer.json``. Special tokens, BOS handling and the chat template come
from ``tokenizer_config.json`` first, then ``config.json`` and
``generation_config.json``, as ``transformers`` reads them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxinfer.errors import ModelLoadError
from jaxinfer.tokenizer.backends import (
    SentencePieceBackend,
    TokenizersBackend,
    read_proto,
    read_tokenizer_json,
)
from jaxinfer.tokenizer.common import (
    JSON_FILE,
    SPM_FILE,
    Backend,
    TokenizerParts,
    id_list,
    read_json,
)


def hf_parts(path: str | os.PathLike[str]) -> TokenizerParts:
    """The tokenizer of the Hugging Face folder ``path``."""
    directory = Path(path)
    if not directory.is_dir():
        raise ModelLoadError(f"tokenizer folder not found: {directory}")
    tok_cfg = read_json(directory / "tokenizer_config.json")
    model_cfg = read_json(directory / "config.json")
    gen_cfg = read_json(directory / "generation_config.json")
    backend = _hf_backend(directory, tok_cfg)
    ids = _hf_special_ids(backend, tok_cfg, model_cfg, gen_cfg)
    add_bos = tok_cfg.get("add_bos_token")
    return TokenizerParts(
        backend,
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
        add_bos=_detect_add_bos(backend, ids["bos"]) if add_bos is None else bool(add_bos),
        stop_token_ids=[
            *id_list(gen_cfg.get("eos_token_id")),
            *id_list(model_cfg.get("eos_token_id")),
        ],
        chat_template=_hf_chat_template(directory, tok_cfg),
    )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_added_tokens(tok_cfg: Mapping[str, Any]) -> dict[str, tuple[int, bool]]:
    decoder = tok_cfg.get("added_tokens_decoder") or {}
    return {
        entry["content"]: (int(i), bool(entry.get("special", False)))
        for i, entry in decoder.items()
        if isinstance(entry, Mapping) and "content" in entry
    }


def _hf_backend(directory: Path, tok_cfg: Mapping[str, Any]) -> Backend:
    if (directory / SPM_FILE).is_file():
        proto = read_proto(directory / SPM_FILE)
        added = _hf_added_tokens(tok_cfg)
        pieces = {p.piece: i for i, p in enumerate(proto.pieces)}
        # keep only what the proto does not already say
        extra = {t: v for t, v in added.items() if pieces.get(t) != v[0] or v[1]}
        return SentencePieceBackend(proto, extra)
    if (directory / JSON_FILE).is_file():
        return TokenizersBackend(read_tokenizer_json(directory / JSON_FILE))
    raise ModelLoadError(f"{directory} has neither {SPM_FILE} nor {JSON_FILE}")


def _hf_special_ids(
    backend: Backend,
    tok_cfg: Mapping[str, Any],
    model_cfg: Mapping[str, Any],
    gen_cfg: Mapping[str, Any],
) -> dict[str, int | None]:
    """bos, eos, pad: tokenizer_config.json, else config.json, generation_config.json, the proto."""
    return {
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


def _hf_special_id(
    backend: Backend, tok_cfg: Mapping[str, Any], name: str, fallbacks: Iterable[Any]
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
        ids = id_list(value)
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


def _proto_id(backend: Backend, name: str) -> int | None:
    if not isinstance(backend, SentencePieceBackend):
        return None
    token_id = getattr(backend.proto.trainer_spec, f"{name}_id")
    return token_id if 0 <= token_id < backend.vocab_size else None


def _detect_add_bos(backend: Backend, bos_id: int | None) -> bool:
    """Whether HF would prepend BOS: its post-processor does it for tokenizer.json models."""
    if bos_id is None:
        return False
    if not isinstance(backend, TokenizersBackend):
        return True
    return backend.prepends(bos_id)
