"""Shared fixtures: the real Gemma 3 270M is loaded once per test session.

Every test that loads the real model's weights carries the `real_model` marker,
so `pytest -m "not real_model"` is the fast subset. Tests that use the fixtures
below get the marker here, mechanically; the few that load the model another
way (their own fixture, or the CLI's default model) mark themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxinfer import LLM
from jaxinfer.weights import LoadedModel, load_model

DATA = Path(__file__).parent / "data"
REAL_MODEL_FIXTURES = frozenset({"gemma", "gemma_llm"})


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
