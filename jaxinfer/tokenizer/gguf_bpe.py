"""A byte-level BPE ``tokenizers.Tokenizer`` from a GGUF's ``tokenizer.ggml.*`` arrays.

A GGUF with ``tokenizer.ggml.model == "gpt2"`` (Llama 3, Qwen2, SmolLM, ...) has no
``tokenizer.json``: it stores the vocabulary in GPT-2's byte alphabet, the merges
as ``"left right"`` strings, a type per token, and in ``tokenizer.ggml.pre`` the
name of the regex that splits text before BPE. The tokenizer is rebuilt here the
way llama.cpp (``llama-vocab.cpp``) and Hugging Face's GGUF converter do:

* the split regex(es) the ``pre`` name stands for, then byte-level mapping;
* BPE over the file's vocabulary (ids unchanged) and merges (rank = position);
* control tokens as special tokens, user-defined ones as added tokens, both
  matched whole in the text and never split;
* ByteLevel decoding.

An unknown ``pre`` name is an error, not a silent fallback: a different split
gives different ids for the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from jaxinfer.errors import ModelLoadError
from jaxinfer.tokenizer.common import CONTROL, NORMAL, USER_DEFINED

# llama.cpp's split regexes (llama-vocab.cpp, llm_tokenizer_bpe), in the spelling the
# models' own tokenizer.json files use (onig has the case-insensitive group).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's fallback for files converted before tokenizer.ggml.pre existed.
DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """How one ``tokenizer.ggml.pre`` family splits text, and its llama.cpp defaults."""

    splits: tuple[str, ...]  # applied in turn, each keeping matches and gaps (llama.cpp)
    digits: bool = False  # every digit on its own first (StarCoder/SmolLM's \p{N})
    ignore_merges: bool = False  # a whole pre-token in the vocabulary is one token
    add_bos: bool = False  # when the file has no tokenizer.ggml.add_bos_token


_GPT2 = PreTokenizer((GPT2_SPLIT,))
_LLAMA3 = PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_QWEN2 = PreTokenizer((QWEN2_SPLIT,))
_DIGITS_GPT2 = PreTokenizer((GPT2_SPLIT,), digits=True)
_DEFAULT = PreTokenizer(DEFAULT_SPLITS)

# tokenizer.ggml.pre names, grouped as llama-vocab.cpp groups them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"),
        _LLAMA3,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((LLAMA3_SPLIT,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _DIGITS_GPT2,
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo"), _GPT2),
    "default": _DEFAULT,
}

# Share of multi-character tokens that no merge makes above which the merges are cut short.
_MAX_UNMADE = 0.01


def pre_tokenizer_for(pre: str, where: str) -> PreTokenizer:
    """The split for ``tokenizer.ggml.pre``; an unknown name is an error (ids would differ)."""
    found = PRE_TOKENIZERS.get(pre)
    if found is None:
        raise ModelLoadError(
            f"{where}: tokenizer.ggml.pre={pre!r} is not a supported pre-tokenizer; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return found


def byte_level_bpe(
    tokens: Sequence[str],
    types: Sequence[int],
    merges: Sequence[str],
    pre: PreTokenizer,
    where: str,
) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` for a GGUF's byte-level BPE vocabulary (ids unchanged)."""
    vocab = {token: i for i, token in enumerate(tokens)}  # a duplicate: the last id, as llama.cpp
    pairs = parse_merges(merges, vocab, where)
    check_merges_complete(tokens, types, pairs, where)
    bpe = models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges)
    tk = tokenizers.Tokenizer(bpe)
    tk.pre_tokenizer = _pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    _add_whole_tokens(tk, tokens, types)
    return tk


def _pre_tokenizer(pre: PreTokenizer) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = []
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pre.splits == (GPT2_SPLIT,):  # ByteLevel's own regex is GPT-2's: HF's exact layout
        return pre_tokenizers.Sequence([*steps, _byte_level(use_regex=True)])
    steps += [
        pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated") for regex in pre.splits
    ]
    return pre_tokenizers.Sequence([*steps, _byte_level(use_regex=False)])


def _byte_level(use_regex: bool) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=use_regex)


def parse_merges(merges: Sequence[str], vocab: dict[str, int], where: str) -> list[tuple[str, str]]:
    """``"left right"`` strings as pairs, each side and their join in the vocabulary."""
    pairs = []
    for rank, merge in enumerate(merges):
        # split at the first space after the first character, as llama.cpp does
        cut = merge.find(" ", 1) if isinstance(merge, str) else -1
        left, right = (merge[:cut], merge[cut + 1 :]) if cut > 0 else (merge, "")
        if not right or left not in vocab or right not in vocab or left + right not in vocab:
            raise ModelLoadError(
                f"{where}: tokenizer.ggml.merges[{rank}]={merge!r} is not two vocabulary "
                "tokens that join into a third; the merges list is corrupt or truncated"
            )
        pairs.append((left, right))
    return pairs


def check_merges_complete(
    tokens: Sequence[str], types: Sequence[int], pairs: Sequence[tuple[str, str]], where: str
) -> None:
    """Fail when many multi-character tokens are made by no merge (a list cut short)."""
    made = {left + right for left, right in pairs}
    multi = [t for t, kind in zip(tokens, types, strict=True) if kind == NORMAL and len(t) > 1]
    unmade = sum(t not in made for t in multi)
    if multi and unmade > _MAX_UNMADE * len(multi):
        raise ModelLoadError(
            f"{where}: tokenizer.ggml.merges looks truncated: {len(pairs)} merges make "
            f"{len(multi) - unmade} of the {len(multi)} multi-character tokens"
        )


def _add_whole_tokens(
    tk: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int]
) -> None:
    """Control tokens as special, user-defined as plain added tokens: matched whole, never split.

    Their text is already in the BPE vocabulary at their own id, so no id changes.
    """
    pairs = list(zip(tokens, types, strict=True))
    special = [t for t, kind in pairs if kind == CONTROL and t]
    user = [t for t, kind in pairs if kind == USER_DEFINED and t]
    tk.add_special_tokens(
        [tokenizers.AddedToken(t, normalized=False, special=True) for t in special]
    )
    tk.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False) for t in user])
