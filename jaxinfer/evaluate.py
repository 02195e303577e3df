"""Perplexity: the quality measure for quantized weights and KV caches.

Perplexity is exp(mean negative log-likelihood) of each next token of a text.
A text longer than the model's window is scored in overlapping windows of at
most `max_len` tokens (Hugging Face's sliding-window recipe): window k starts
at k * stride; the first window scores every token after its first, each later
one only the tokens past the previous window's end, the rest is context. Every
token after the first is scored exactly once.

Scoring goes through the serving path, not a dense side door: each window is
one request to `LLM.generate` with `SamplingParams(prompt_logprobs=0)`, so the
paged KV cache (float or int8), the quantized weights and the chunked prefill
all take part, exactly as they do when the engine serves.

The evaluation texts are the long descriptions that installed packages ship in
their `*.dist-info/METADATA` (jax, sentencepiece, ...), with Markdown stripped
to prose. Nothing in jaxinfer calibrates or tunes on them; AWQ calibrates on
Python standard-library docstrings, which are not used here.

`llama_cpp_perplexities` scores the same token ids with llama.cpp
(llama-cpp-python, optional) on the same windows, as an outside reference.
"""

from __future__ import annotations

import importlib.metadata
import math
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jaxinfer.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.llm import LLM
    from jaxinfer.weights import LoadedModel

DEFAULT_TEXTS = ("jax", "sentencepiece", "tokenizers", "rich", "msgpack")
DEFAULT_NUM_TOKENS = 1024
DEFAULT_MAX_LEN = 1024
_LOG_SOFTMAX_ROWS = 64  # llama.cpp scores: rows of [V] logits normalized at a time


class TextEncoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


# --------------------------------------------------------------------------- windows


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) go to the model; tokens [score_from, end) are scored."""

    begin: int
    score_from: int
    end: int


def plan_windows(num_tokens: int, max_len: int, stride: int | None = None) -> list[Window]:
    """Windows over a sequence of num_tokens ids; stride defaults to max_len // 2.

    As in Hugging Face's recipe, window k starts at k * stride and is at most
    max_len long; it scores the tokens after the previous window's end (the
    first window: every token after its first), the rest is context.
    """
    stride = max_len // 2 if stride is None else stride
    if max_len < 2:
        raise ConfigError(f"max_len must be >= 2, got {max_len}")
    if not 1 <= stride < max_len:
        raise ConfigError(f"stride must be in [1, max_len - 1 = {max_len - 1}], got {stride}")
    if num_tokens < 2:
        raise ConfigError(f"need at least 2 tokens to score, got {num_tokens}")
    windows, begin, scored_to = [], 0, 1
    while scored_to < num_tokens:
        end = min(begin + max_len, num_tokens)
        windows.append(Window(begin, scored_to, end))
        begin, scored_to = begin + stride, end
    return windows


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PerplexityResult:
    """Log-probs of the scored tokens, in sequence order."""

    logprobs: np.ndarray  # [num_tokens] f64

    @property
    def num_tokens(self) -> int:
        return int(self.logprobs.size)

    @property
    def nll(self) -> float:
        """Total negative log-likelihood (nats)."""
        return float(-self.logprobs.sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.num_tokens)

    @staticmethod
    def combine(results: Sequence[PerplexityResult]) -> PerplexityResult:
        """All scored tokens of several results as one (token-weighted mean NLL)."""
        return PerplexityResult(np.concatenate([r.logprobs for r in results]))


def _score_windows(sequences: Sequence[Sequence[int]], max_len: int, stride: int | None,
                   score: Callable[[list[tuple[Sequence[int], Window]]], list[np.ndarray]],
                   ) -> list[PerplexityResult]:
    """Plan every sequence's windows, score them all in one call, reassemble per sequence."""
    plans = [plan_windows(len(ids), max_len, stride) for ids in sequences]
    jobs = [(ids, w) for ids, plan in zip(sequences, plans, strict=True) for w in plan]
    scores = iter(score(jobs))
    return [PerplexityResult(np.concatenate([next(scores) for _ in plan])) for plan in plans]


# --------------------------------------------------------------------------- serving path


def perplexities(llm: LLM, sequences: Sequence[Sequence[int]], *,
                 max_len: int = DEFAULT_MAX_LEN, stride: int | None = None,
                 ) -> list[PerplexityResult]:
    """Perplexity of each token sequence through `llm` (a jaxinfer LLM), all windows
    of all sequences batched into one `generate` call."""
    return _score_windows(sequences, max_len, stride, lambda jobs: _engine_scores(llm, jobs))


def _engine_scores(llm: LLM, jobs: list[tuple[Sequence[int], Window]]) -> list[np.ndarray]:
    from jaxinfer.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    prompts = [list(ids[w.begin:w.end]) for ids, w in jobs]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [_window_logprobs(out.prompt_logprobs, prompt, w)
            for out, prompt, (_, w) in zip(outputs, prompts, jobs, strict=True)]


def _window_logprobs(entries: list[dict[int, float] | None] | None, prompt: list[int],
                     w: Window) -> np.ndarray:
    """[end - score_from] log-probs of the scored tokens from one request's prompt_logprobs."""
    if entries is None or len(entries) != len(prompt):
        got = 0 if entries is None else len(entries)
        raise RuntimeError(f"the engine returned {got} prompt log-probs for a {len(prompt)}-token "
                           "window (was the request preempted? raise --kv-cache-memory)")
    offsets = range(w.score_from - w.begin, w.end - w.begin)
    return np.array([entries[i][prompt[i]] for i in offsets], np.float64)


# --------------------------------------------------------------------------- texts


_FENCED_CODE = re.compile(r"^ *```.*?^ *```[ \t]*$", re.M | re.S)
_HTML_TAG = re.compile(r"<[^>\n]+>")
_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_EMPHASIS = re.compile(r"\*\*|`")
_HEADING = re.compile(r"^#+ *", re.M)


def strip_markdown(text: str) -> str:
    """Markdown to prose, minimally: drop code blocks, HTML tags and images; keep link
    text; drop bold and code markers and heading hashes; collapse blank lines."""
    for pattern, repl in ((_FENCED_CODE, ""), (_HTML_TAG, ""), (_IMAGE, ""), (_LINK, r"\1"),
                          (_EMPHASIS, ""), (_HEADING, "")):
        text = pattern.sub(repl, text)
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def load_text(name: str) -> str:
    """The long description of the installed distribution `name`, as prose."""
    try:
        meta = importlib.metadata.metadata(name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(f"evaluation text {name!r} needs the package {name!r}, which is not "
                          f"installed (pip install {name}); defaults: {', '.join(DEFAULT_TEXTS)}"
                          ) from exc
    body = meta.get_payload() or meta.get("Description") or ""
    return strip_markdown(body)


def text_token_ids(tokenizer: TextEncoder, name: str,
                   num_tokens: int = DEFAULT_NUM_TOKENS) -> list[int]:
    """The first num_tokens ids of text `name` (BOS first if the model wants one)."""
    ids = tokenizer.encode(load_text(name))
    if len(ids) < num_tokens:
        raise ConfigError(f"evaluation text {name!r} has only {len(ids)} tokens; "
                          f"ask for at most that many (--num-tokens)")
    return list(ids[:num_tokens])


class ByteEncoder:
    """Ids = UTF-8 bytes: the stand-in for models that ship no tokenizer (test models)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def text_encoder(loaded: LoadedModel) -> TextEncoder:
    """The model's tokenizer; UTF-8 bytes when it has none (needs vocab_size >= 256)."""
    if loaded.tokenizer is not None:
        return loaded.tokenizer
    if loaded.config.vocab_size < 256:
        raise ConfigError(f"{loaded.source} has no tokenizer and a vocabulary of "
                          f"{loaded.config.vocab_size} < 256, too small to score UTF-8 bytes")
    return ByteEncoder()


# --------------------------------------------------------------------------- llama.cpp


def llama_cpp_perplexities(model_path: Path, sequences: Sequence[Sequence[int]], *,
                           max_len: int = DEFAULT_MAX_LEN, stride: int | None = None,
                           ) -> list[PerplexityResult]:
    """Perplexity of the same token ids under llama.cpp, on the same windows."""
    from jaxinfer.bench.llama_cpp_peer import import_llama_cpp

    llm = import_llama_cpp().Llama(str(model_path), logits_all=True, n_ctx=max_len, n_batch=max_len,
                n_threads=os.cpu_count(), verbose=False)
    try:
        return _score_windows(sequences, max_len, stride,
                              lambda jobs: [_llama_cpp_window(llm, ids, w) for ids, w in jobs])
    finally:
        llm.close()


def _llama_cpp_window(llm: object, ids: Sequence[int], w: Window) -> np.ndarray:
    """[end - score_from] log-probs: row i of llama.cpp's scores predicts token begin + i + 1."""
    llm.reset()
    llm.eval([int(t) for t in ids[w.begin:w.end]])
    rows = np.arange(w.score_from - w.begin - 1, w.end - w.begin - 1)  # [n]
    targets = np.asarray(ids[w.score_from:w.end], np.int64)  # [n]
    out = np.empty(rows.size, np.float64)
    for lo in range(0, rows.size, _LOG_SOFTMAX_ROWS):
        logits = llm.scores[rows[lo:lo + _LOG_SOFTMAX_ROWS]].astype(np.float64)  # [r, V]
        top = logits.max(axis=-1)
        lse = top + np.log(np.exp(logits - top[:, None]).sum(axis=-1))
        picked = logits[np.arange(len(logits)), targets[lo:lo + _LOG_SOFTMAX_ROWS]]
        out[lo:lo + _LOG_SOFTMAX_ROWS] = picked - lse
    return out




# --------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class Setting:
    """One way to serve the model: weight quantization and KV cache type."""

    name: str
    quantization: str = "none"
    kv_cache_dtype: str = "auto"


# Ordered so the float weights load once for the baseline and the int8 KV cache.
ALL_SETTINGS = (
    Setting("baseline"),
    Setting("kv-int8", kv_cache_dtype="int8"),
    Setting("int8", quantization="int8"),
    Setting("w8a8", quantization="w8a8"),
    Setting("int4", quantization="int4"),
    Setting("int4-awq", quantization="int4-awq"),
)
LLAMA_CPP = Setting("llama.cpp", quantization="gguf", kv_cache_dtype="f16")


@dataclass
class SettingScores:
    """One setting's perplexity on each text, and how long the scoring took."""

    setting: Setting
    results: list[PerplexityResult]  # one per text
    seconds: float

    @property
    def mean(self) -> PerplexityResult:
        """All texts' tokens together: exp of the token-weighted mean NLL."""
        return PerplexityResult.combine(self.results)


@dataclass(frozen=True)
class EvalTask:
    """What to score and how: texts, their token ids, and the windows."""

    texts: tuple[str, ...]
    sequences: tuple[tuple[int, ...], ...]  # one per text
    max_len: int = DEFAULT_MAX_LEN
    stride: int | None = None


def score_setting(task: EvalTask, setting: Setting, loaded: LoadedModel,
                  engine_config: EngineConfig) -> SettingScores:
    """Serve `loaded` with the setting's KV cache type and score every text."""
    from jaxinfer.llm import LLM

    if task.max_len >= loaded.config.max_position:
        raise ConfigError(f"max_len ({task.max_len}) must be below the model's context length "
                          f"({loaded.config.max_position}): a window plus one generated token "
                          "must fit")
    start = time.perf_counter()
    config = engine_config.replace(kv_cache_dtype=setting.kv_cache_dtype)
    llm = LLM(loaded=loaded, engine_config=config)
    results = perplexities(llm, task.sequences, max_len=task.max_len, stride=task.stride)
    return SettingScores(setting, results, time.perf_counter() - start)


def setting_for(quantization: str, kv_cache_dtype: str) -> Setting:
    """A named setting: "baseline", "int8", "kv-int8", "int4+kv-int8", ..."""
    parts = [quantization] if quantization != "none" else []
    parts += [f"kv-{kv_cache_dtype}"] if kv_cache_dtype != "auto" else []
    return Setting("+".join(parts) or "baseline", quantization, kv_cache_dtype)


def score_settings(settings: Sequence[Setting], load: Callable[[str], LoadedModel],
                   engine_config: EngineConfig, *, texts: Sequence[str], num_tokens: int,
                   max_len: int = DEFAULT_MAX_LEN, stride: int | None = None,
                   ) -> tuple[list[SettingScores], EvalTask]:
    """Score each setting in turn; `load(quantization)` gives a LoadedModel. Weights
    load once per run of settings with the same quantization, and one at a time."""
    rows: list[SettingScores] = []
    loaded, task = None, None
    for setting in settings:
        reused = loaded is not None and loaded.quantization == setting.quantization
        if not reused:
            loaded = None  # let the previous weights go before the next load
            loaded = load(setting.quantization)
        if task is None:
            encoder = text_encoder(loaded)
            sequences = tuple(tuple(text_token_ids(encoder, t, num_tokens)) for t in texts)
            task = EvalTask(tuple(texts), sequences, max_len, stride)
        rows.append(score_setting(task, setting, loaded, engine_config))
        loading = "weights reused" if reused else f"loaded in {loaded.load_seconds:.1f}s"
        print(f"[{setting.name}: ppl {rows[-1].mean.ppl:.4f}, {loading}, "
              f"scored in {rows[-1].seconds:.1f}s]", file=sys.stderr)
    return rows, task


def score_llama_cpp(task: EvalTask, model: str | Path) -> SettingScores:
    """The same token ids and windows under llama.cpp, in a child process: a crash in
    the native library is reported as an error instead of ending this process."""
    from jaxinfer.bench.llama_cpp_peer import default_gguf

    path = default_gguf(str(model))
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        job = pool.submit(llama_cpp_perplexities, path, task.sequences,
                          max_len=task.max_len, stride=task.stride)
        try:
            results = job.result()
        except BrokenProcessPool as exc:
            raise ModelLoadError(f"llama.cpp crashed while scoring {path.name} (its process "
                                 "died; try the llama-cpp-python build on a plain completion)"
                                 ) from exc
    return SettingScores(LLAMA_CPP, results, time.perf_counter() - start)


def format_table(rows: Sequence[SettingScores], task: EvalTask) -> str:
    """One line per text and one for the mean (columns: settings), then each
    setting's mean ratio to the first column."""
    width = max(12, *(len(r.setting.name) + 2 for r in rows))
    lines = [f"{'text':<16}{'scored':>8}" + "".join(f"{r.setting.name:>{width}}" for r in rows)]
    for i, name in enumerate(task.texts):
        cells = "".join(f"{r.results[i].ppl:>{width}.4f}" for r in rows)
        lines.append(f"{name:<16}{rows[0].results[i].num_tokens:>8}{cells}")
    cells = "".join(f"{r.mean.ppl:>{width}.4f}" for r in rows)
    lines.append(f"{'mean':<16}{rows[0].mean.num_tokens:>8}{cells}")
    base = rows[0].mean.ppl
    lines.append(f"{'ratio':<24}" + "".join(f"{r.mean.ppl / base:>{width}.4f}" for r in rows))
    return "\n".join(lines)


def report_json(rows: Sequence[SettingScores], task: EvalTask) -> dict[str, object]:
    """The report as plain data: per setting, the mean and each text's ppl and NLL."""
    base = rows[0].mean.ppl
    return {
        "texts": list(task.texts), "max_len": task.max_len, "stride": task.stride,
        "settings": [{
            "name": r.setting.name, "quantization": r.setting.quantization,
            "kv_cache_dtype": r.setting.kv_cache_dtype, "seconds": round(r.seconds, 2),
            "ppl": r.mean.ppl, "nll": r.mean.nll, "num_tokens": r.mean.num_tokens,
            "ratio": r.mean.ppl / base,
            "per_text": {name: {"ppl": res.ppl, "nll": res.nll, "num_tokens": res.num_tokens}
                         for name, res in zip(task.texts, r.results, strict=True)},
        } for r in rows],
    }

