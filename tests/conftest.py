"""Shared fixtures: the real Gemma 3 270M is loaded once per test session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from jaxinfer import LLM
from jaxinfer.weights import LoadedModel, load_model

DATA = Path(__file__).parent / "data"
# Tests compile afresh and write nothing under ~/.cache: the commands they run keep
# the compilation cache off unless a test (or the caller's environment) asks for it.
os.environ.setdefault("JAXINFER_COMPILATION_CACHE", "off")



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
