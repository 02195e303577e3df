"""Synthetic, seeded benchmark workloads built from token ids.

Prompts are cut from real English text (the Python documentation shipped in
the standard library's `pydoc_data`) tokenized once by the model's own
tokenizer, or, for a model without one, from random ids below `vocab_size`.
Every request asks for an exact number of new tokens (greedy, EOS ignored),
so the same workload costs the same work on any engine. Sizes scale down to
fit `max_model_len`, keeping each workload's shape.

Workloads:
- `long-prompt-short-answer`: a 4k–8k-token document and a question, ~20 out;
- `short-prompt-long-answer`: ~20 tokens in, 1000 out;
- `shared-prefix`: one long system prompt, then many different questions;
- `mixed`: heavy-tailed (lognormal) prompt and answer lengths, like a chat log;
- `fixed`: every prompt `--input-len` tokens, every answer `--output-len`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxinfer.errors import ConfigError

WORKLOADS = ("long-prompt-short-answer", "short-prompt-long-answer", "shared-prefix", "mixed",
             "fixed")
CORPUS_CHARS = 200_000  # enough text for ~50k tokens; tokenized once per run
MIN_CORPUS_TOKENS = 8192


@dataclass(frozen=True)
class BenchRequest:
    """One request: the exact prompt ids and the exact number of new tokens."""

    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + self.output_len


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    requests: tuple[BenchRequest, ...]


@dataclass(frozen=True)
class TokenSource:
    """Where prompt ids come from: a long run of real-text ids, or random ids."""

    corpus: tuple[int, ...]  # real text tokenized; empty: draw random ids
    prefix: tuple[int, ...]  # prepended to every prompt (BOS)
    vocab_size: int

    def span(self, rng: np.random.Generator, length: int) -> list[int]:
        """`length` ids: a random window of the corpus (wrapping), or random ids."""
        if length <= 0:
            return []
        if not self.corpus:
            low = min(4, self.vocab_size - 1)  # keep clear of the usual special ids
            return rng.integers(low, self.vocab_size, size=length).tolist()
        start = int(rng.integers(0, len(self.corpus)))
        reps = (start + length) // len(self.corpus) + 1
        return list((self.corpus * reps)[start:start + length])

    def prompt(self, rng: np.random.Generator, length: int) -> list[int]:
        """A prompt of exactly `length` ids (at least 1), the prefix included."""
        prefix = list(self.prefix[: max(0, length - 1)])
        return prefix + self.span(rng, max(1, length - len(prefix)))


def text_corpus() -> str:
    """English text shipped with Python (its documentation topics), or '' if absent."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return ""
    return "\n\n".join(topics[key] for key in sorted(topics))[:CORPUS_CHARS]


def token_source(
    encode: Callable[[str], Sequence[int]] | None, vocab_size: int, prefix: Sequence[int] = (),
) -> TokenSource:
    """Ids of real text when there is a tokenizer (`encode`, without BOS), else random."""
    text = text_corpus() if encode is not None else ""
    corpus = [int(i) for i in encode(text)] if text and encode is not None else []
    corpus = [i for i in corpus if 0 <= i < vocab_size]
    if corpus and len(corpus) < MIN_CORPUS_TOKENS:
        corpus = corpus * (MIN_CORPUS_TOKENS // len(corpus) + 1)
    return TokenSource(tuple(corpus), tuple(prefix), vocab_size)


def make_workload(
    name: str, source: TokenSource, *, num_prompts: int, max_model_len: int, seed: int = 0,
    input_len: int | None = None, output_len: int | None = None,
) -> Workload:
    """`num_prompts` requests of workload `name`, each fitting `max_model_len`."""
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; workloads: {', '.join(WORKLOADS)}")
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    if max_model_len < 4:
        raise ConfigError(f"max_model_len must be >= 4 for a workload, got {max_model_len}")
    rng = np.random.default_rng(seed)
    build = _BUILDERS[name]
    lengths = build(rng, num_prompts, max_model_len, input_len, output_len)
    if name == "shared-prefix":
        requests = _shared_prefix(rng, source, lengths, max_model_len)
    else:
        requests = [BenchRequest(tuple(source.prompt(rng, p)), o) for p, o in lengths]
    return Workload(name, seed, tuple(requests))


def _check_positive(**values: int | None) -> None:
    for flag, value in values.items():
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")


def fit(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """Shrink (prompt, output) to fit max_model_len (both >= 1): the output first, down
    to a quarter of the context, then the prompt."""
    if prompt_len + output_len <= max_model_len:
        return prompt_len, output_len
    output_len = max(1, min(output_len, max_model_len // 4))
    return max(1, min(prompt_len, max_model_len - output_len)), output_len


Lengths = list[tuple[int, int]]


def _long_prompt(rng: np.random.Generator, n: int, ctx: int, inp: int | None,
                 out: int | None) -> Lengths:
    """4k–8k-token document + a 16–48-token question, 20 out; scaled to the context."""
    out = out or 20
    scale = min(1.0, (ctx - out) / (8192 + 48))
    docs = rng.integers(4096, 8193, size=n) if inp is None else np.full(n, inp)
    questions = rng.integers(16, 49, size=n)
    return [fit(int((d + q) * (scale if inp is None else 1.0)), out, ctx)
            for d, q in zip(docs, questions, strict=True)]


def _short_prompt(rng: np.random.Generator, n: int, ctx: int, inp: int | None,
                  out: int | None) -> Lengths:
    """~20 tokens in (16–24), 1000 out; the output shrinks to fit the context."""
    prompts = rng.integers(16, 25, size=n) if inp is None else np.full(n, inp)
    return [_fit_output(int(p), out or 1000, ctx) for p in prompts]


def _fit_output(prompt_len: int, output_len: int, ctx: int) -> tuple[int, int]:
    prompt_len = min(prompt_len, ctx - 1)
    return prompt_len, max(1, min(output_len, ctx - prompt_len))


def _shared_prefix_lengths(rng: np.random.Generator, n: int, ctx: int, inp: int | None,
                           out: int | None) -> Lengths:
    """Question lengths (16–64) and outputs (default 32); the prefix is sized later."""
    questions = rng.integers(16, 65, size=n) if inp is None else np.full(n, inp)
    return [(int(q), out or 32) for q in questions]


def _mixed(rng: np.random.Generator, n: int, ctx: int, inp: int | None,
           out: int | None) -> Lengths:
    """Lognormal lengths like a chat log: prompts median ~256, answers median ~128."""
    prompts = np.clip(rng.lognormal(np.log(256), 1.0, size=n), 4, None).astype(int)
    answers = np.clip(rng.lognormal(np.log(128), 0.8, size=n), 1, None).astype(int)
    scale = min(1.0, ctx / 4096)  # keep the shape in small contexts
    return [fit(inp or max(4, int(p * scale)), out or max(1, int(a * scale)), ctx)
            for p, a in zip(prompts, answers, strict=True)]


def _fixed(rng: np.random.Generator, n: int, ctx: int, inp: int | None,
           out: int | None) -> Lengths:
    return [fit(inp or 128, out or 128, ctx)] * n


_BUILDERS = {
    "long-prompt-short-answer": _long_prompt,
    "short-prompt-long-answer": _short_prompt,
    "shared-prefix": _shared_prefix_lengths,
    "mixed": _mixed,
    "fixed": _fixed,
}


def _shared_prefix(rng: np.random.Generator, source: TokenSource, lengths: Lengths,
                   ctx: int) -> list[BenchRequest]:
    """One system prompt (2048 tokens, at most half the context) before every question."""
    longest = max(q + o for q, o in lengths)
    system_len = max(1, min(2048, ctx // 2, ctx - min(longest, ctx // 2)))
    system = source.prompt(rng, system_len)
    requests = []
    for question, output in lengths:
        question, output = fit(question, output, ctx - system_len)
        requests.append(BenchRequest(tuple(system + source.span(rng, question)), output))
    return requests


def perturbed(workload: Workload, vocab_size: int) -> Workload:
    """The same shapes with other ids (each prompt's second id, or its only one, changed),
    so a warm-up run compiles the step shapes without seeding the prefix cache."""
    requests = []
    for r in workload.requests:
        ids = list(r.prompt_ids)
        at = min(1, len(ids) - 1)
        ids[at] = (ids[at] + 1) % vocab_size
        requests.append(BenchRequest(tuple(ids), r.output_len))
    return Workload(workload.name + "-warmup", workload.seed, tuple(requests))
