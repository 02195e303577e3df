"""Shared fixtures: the real Gemma 3 270M is loaded once per test session.

Every test that loads the real model's weights carries the `real_model` marker,
so `pytest -m "not real_model"` is the fast subset. Tests that use the fixtures
below get the marker here, mechanically; the few that load the model another
way (their own fixture, or the CLI's default model) mark themselves.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from jaxinfer import LLM
from jaxinfer.weights import LoadedModel, load_model

# tests/mesh needs 8 devices: tests/test_mesh.py runs it in a process of its own.
collect_ignore = [] if os.environ.get("JAXINFER_MESH_SUITE") else ["mesh"]

DATA = Path(__file__).parent / "data"
TINY = DATA / "tiny"
REAL_MODEL_FIXTURES = frozenset({"gemma", "gemma_llm"})

# Tests compile afresh and write nothing under ~/.cache: the commands they run keep
# the compilation cache off unless a test (or the caller's environment) asks for it.
os.environ.setdefault("JAXINFER_COMPILATION_CACHE", "off")


# Every program XLA compiles for the CPU holds memory maps of its code, and the Pallas
# and TPU interpreters compile thousands of small programs. Past Linux's default limit
# of 65,530 maps a process, XLA crashes in the next compilation, so a module that
# leaves many maps behind drops JAX's caches (later modules recompile what they use).
MAX_MEMORY_MAPS = 20_000
MAPS_FILE = Path("/proc/self/maps")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> Iterator[None]:
    yield
    if MAPS_FILE.exists() and len(MAPS_FILE.read_text().splitlines()) > MAX_MEMORY_MAPS:
        jax.clear_caches()
        gc.collect()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def reference() -> dict:
    """HF transformers' outputs on the shipped GGUF (scripts/make_reference.py)."""
    return json.loads((DATA / "gemma3_270m_reference.json").read_text())


@pytest.fixture(scope="session")
def gemma() -> LoadedModel:
    return load_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma_llm(gemma: LoadedModel) -> LLM:
    return LLM(loaded=gemma, max_model_len=2048, max_num_seqs=8)


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama HF folder plus a BPE tokenizer of exactly its 256 ids, so text
    prompts (lower-case letters and spaces) reach a model that compiles in seconds."""
    folder = tmp_path_factory.mktemp("tiny_llama_with_tokenizer")
    for file in (TINY / "llama").iterdir():
        shutil.copy(file, folder)
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    syllables = ["ka", "to", "ri", "me", "sun", "lo", "pa", "ne", "the", "cat", "sat", "on",
                 "mat"]
    words = ("".join(w) for w in itertools.product(syllables, repeat=3))
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator([" ".join(words)], trainer)
    assert tokenizer.get_vocab_size() == 256  # every id the model can sample decodes
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])  # the model's bos_token_id
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder
