"""Orbax checkpoints and the dummy loader."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import full_logits

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.params import param_shapes
from jaxinfer.weights import load_model
from jaxinfer.weights.orbax_ckpt import save_checkpoint

TINY = Path(__file__).parent / "data" / "tiny"


def test_orbax_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    original = load_model(TINY / "gemma3")
    save_checkpoint(tmp_path / "ckpt", original.config, original.params)
    restored = load_model(tmp_path / "ckpt")
    assert restored.kind == "checkpoint" and restored.config == original.config
    tokens = np.load(TINY / "gemma3" / "expected.npz")["tokens"]
    before = np.asarray(full_logits(original.params, original.config, tokens))
    after = np.asarray(full_logits(restored.params, restored.config, tokens))
    np.testing.assert_array_equal(before, after)


def test_saving_over_a_checkpoint_is_refused(tmp_path: Path) -> None:
    model = load_model(TINY / "qwen2")
    save_checkpoint(tmp_path / "ckpt", model.config, model.params)
    with pytest.raises(ModelLoadError, match="already holds a checkpoint"):
        save_checkpoint(tmp_path / "ckpt", model.config, model.params)


def test_damaged_checkpoint_is_named(tmp_path: Path) -> None:
    model = load_model(TINY / "qwen2")
    save_checkpoint(tmp_path / "ckpt", model.config, model.params)
    (tmp_path / "ckpt" / "model_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a readable jaxinfer checkpoint"):
        load_model(tmp_path / "ckpt")


def test_dummy_weights_have_the_preset_shapes() -> None:
    model = load_model("qwen2.5-0.5b", load_format="dummy")
    shapes = [tuple(np.shape(leaf)) for leaf in jax.tree.leaves(model.params)]
    expected = jax.tree.leaves(param_shapes(model.config), is_leaf=lambda x: isinstance(x, tuple))
    assert shapes == expected
    assert model.config.qkv_bias and model.tokenizer is None


def test_unknown_model_name_lists_presets() -> None:
    with pytest.raises(ModelLoadError, match="gemma3-270m"):
        load_model("no-such-model")


def test_preset_without_weights_says_what_to_do() -> None:
    with pytest.raises(ModelLoadError, match="load-format dummy"):
        load_model("llama-3.2-1b")
