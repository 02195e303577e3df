"""llama.cpp as the reference peer: the same token ids through llama-cpp-python.

It runs on the same GGUF with llama.cpp's own multi-sequence batching through
the low-level API: one `llama_batch` per step holds the new prompts' tokens
(several sequences packed, up to `n_batch` tokens) or one token of every
running sequence, each tagged with its `seq_id`; greedy argmax of each
sequence's logits picks its next token. Sequences are admitted as room frees
up (continuous batching, at most `n_seq_max` at once) and, given arrival
times, no earlier than their arrival (for the serving comparison). Exactly
`output_len` tokens are generated per request, EOS ignored, as on our side.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from jaxinfer.bench.stats import RequestRecord
from jaxinfer.bench.workloads import BenchRequest
from jaxinfer.errors import ConfigError

INSTALL_HINT = "pip install 'jaxinfer[llama-cpp]' (or the llama-cpp-python wheel)"
N_BATCH = 2048
# llama.cpp's repacked weight layouts (its fast CPU path) are on unless this is "0": a
# llama-cpp-python built with AMX segfaults in llama_decode with them on AMX CPUs.
EXTRA_BUFFERS = os.environ.get("JAXINFER_LLAMA_CPP_EXTRA_BUFFERS", "1") == "1"


def import_llama_cpp() -> Any:
    """The llama_cpp module, or a ConfigError naming the fix."""
    try:
        import llama_cpp
    except ImportError:
        raise ConfigError(f"--compare llama-cpp needs llama-cpp-python: {INSTALL_HINT}") from None
    return llama_cpp


def default_gguf(model: str) -> Path:
    """The GGUF behind `--model`: a .gguf path, or a preset that ships one."""
    from jaxinfer.weights import load_preset, resolve_source

    path = Path(model)
    if path.is_file():
        return path
    if path.exists():
        raise ConfigError(f"--compare llama-cpp needs a GGUF model file; {model} is a folder")
    preset = load_preset(model)
    if preset.source is None:
        raise ConfigError(f"preset {model!r} ships no GGUF to compare with llama.cpp")
    return resolve_source(preset.source)


@dataclass
class _PeerSequence:
    """A running sequence: its request, tokens so far and their arrival times."""

    seq_id: int
    request: BenchRequest
    start: float  # arrival (perf_counter seconds)
    tokens: list[int] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.output_len

    def record(self) -> RequestRecord:
        gaps = [b - a for a, b in itertools.pairwise(self.stamps)]
        return RequestRecord(len(self.request.prompt_ids), len(self.tokens),
                             self.stamps[0] - self.start, self.stamps[-1] - self.start, gaps)


Entry = tuple[int, int, int, bool]  # (token, position, seq_id, wants logits)


class _Context:
    """One llama.cpp context (unified KV cache of `n_ctx` cells) and its batch buffer."""

    def __init__(self, lib: Any, model: Any, n_ctx: int, n_seq_max: int, n_threads: int) -> None:
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_seq_max = n_ctx, N_BATCH, n_seq_max
        params.n_threads = params.n_threads_batch = n_threads
        params.kv_unified, params.no_perf = True, True
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise ConfigError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self.lib, self.n_ctx, self.n_seq_max = lib, n_ctx, n_seq_max
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self.memory = lib.llama_get_memory(self.ctx)

    def decode(self, entries: Sequence[Entry]) -> list[int]:
        """Run entries (at most N_BATCH); the greedy next token of each that wants logits."""
        batch = self.batch
        for i, (token, position, seq_id, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq_id, logits
        batch.n_tokens = len(entries)
        status = self.lib.llama_decode(self.ctx, batch)
        if status != 0:
            raise ConfigError(f"llama_decode failed with status {status} "
                              f"(KV cache of {self.n_ctx} cells full?)")
        return [self._argmax(i) for i, entry in enumerate(entries) if entry[3]]

    def _argmax(self, i: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, i)  # float[n_vocab]
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def forget(self, seq_id: int) -> None:
        self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


class LlamaCppPeer:
    """The GGUF loaded once in llama.cpp; `generate` runs a workload through it."""

    def __init__(self, gguf: Path, n_threads: int | None = None,
                 extra_buffers: bool = EXTRA_BUFFERS) -> None:
        """`extra_buffers`: llama.cpp's repacked weight layouts (default on; see
        EXTRA_BUFFERS for the AMX build that crashes with them)."""
        lib = self.lib = import_llama_cpp()
        _silence(lib)
        lib.llama_backend_init()
        start = time.perf_counter()
        params = lib.llama_model_default_params()
        params.use_extra_bufts = extra_buffers
        self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise ConfigError(f"llama.cpp could not load {gguf}")
        self.load_seconds = time.perf_counter() - start
        self.gguf = gguf
        self.n_threads = n_threads or os.cpu_count() or 1
        self._context: _Context | None = None

    def context(self, n_seq_max: int, n_ctx: int) -> _Context:
        """A context with at least these sizes (reused when the current one fits)."""
        current = self._context
        if current is not None and current.n_seq_max == n_seq_max and current.n_ctx >= n_ctx:
            current.clear()
            return current
        if current is not None:
            current.close()
        n_ctx = -(-n_ctx // 256) * 256
        self._context = _Context(self.lib, self.model, n_ctx, n_seq_max, self.n_threads)
        return self._context

    def generate(self, requests: Sequence[BenchRequest], max_seqs: int,
                 arrivals: Sequence[float] | None = None) -> tuple[list[RequestRecord], float]:
        """Run every request (continuous batching, at most `max_seqs` at once; request i
        admitted no earlier than `arrivals[i]` seconds after the start). Returns the
        records in request order and the wall time."""
        longest = max(r.total_len for r in requests)
        ctx = self.context(max_seqs, longest * min(max_seqs, len(requests)))
        start = time.perf_counter()
        due = [start + (arrivals[i] if arrivals else 0.0) for i in range(len(requests))]
        records: list[RequestRecord | None] = [None] * len(requests)
        waiting, running = deque(range(len(requests))), {}
        free = list(range(max_seqs))[::-1]
        while waiting or running:
            admitted = _admit(waiting, free, requests, due)
            if admitted:
                _prefill(ctx, admitted)
                running |= {index: seq for index, seq in admitted}
            elif not running:
                time.sleep(max(0.0, due[waiting[0]] - time.perf_counter()))
                continue
            _decode(ctx, [s for s in running.values() if not s.done])
            for index in [i for i, s in running.items() if s.done]:
                seq = running.pop(index)
                records[index] = seq.record()
                ctx.forget(seq.seq_id)
                free.append(seq.seq_id)
        return [r for r in records if r is not None], time.perf_counter() - start

    def close(self) -> None:
        if self._context is not None:
            self._context.close()
            self._context = None
        self.lib.llama_model_free(self.model)


def _admit(waiting: deque[int], free: list[int], requests: Sequence[BenchRequest],
           due: Sequence[float]) -> list[tuple[int, _PeerSequence]]:
    """Take waiting requests that have arrived, while sequence ids are free."""
    admitted = []
    now = time.perf_counter()
    while waiting and free and due[waiting[0]] <= now:
        index = waiting.popleft()
        admitted.append((index, _PeerSequence(free.pop(), requests[index], due[index])))
    return admitted


def _prefill(ctx: _Context, admitted: list[tuple[int, _PeerSequence]]) -> None:
    """All new prompts, packed into batches of N_BATCH tokens; each gets its first token."""
    entries = [(token, position, seq.seq_id, position == len(seq.request.prompt_ids) - 1)
               for _, seq in admitted for position, token in enumerate(seq.request.prompt_ids)]
    firsts = []
    for chunk in _chunks(entries, N_BATCH):
        firsts += ctx.decode(chunk)
    now = time.perf_counter()
    for (_, seq), token in zip(admitted, firsts, strict=True):
        seq.tokens.append(token)
        seq.stamps.append(now)


def _decode(ctx: _Context, seqs: list[_PeerSequence]) -> None:
    """One token for every running sequence, in one batch."""
    if not seqs:
        return
    entries = [(s.tokens[-1], len(s.request.prompt_ids) + len(s.tokens) - 1, s.seq_id, True)
               for s in seqs]
    tokens = []
    for chunk in _chunks(entries, N_BATCH):
        tokens += ctx.decode(chunk)
    now = time.perf_counter()
    for seq, token in zip(seqs, tokens, strict=True):
        seq.tokens.append(token)
        seq.stamps.append(now)


def _chunks(items: list[Entry], size: int) -> Iterator[list[Entry]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


_LOG_CALLBACK: Any = None


def _silence(lib: Any) -> None:
    """Drop llama.cpp's log lines (model loading chatter on stderr)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = lib.llama_log_callback(lambda _level, _text, _data: None)
    lib.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


@contextlib.contextmanager
def open_peer(gguf: Path) -> Iterator[LlamaCppPeer]:
    peer = LlamaCppPeer(gguf)
    try:
        yield peer
    finally:
        peer.close()
