"""Capturing the model's intermediates from a jitted forward (tiny random model)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model.capture import capture_intermediates, tap
from jaxinfer.model.layers import activation, linear, rms_norm
from jaxinfer.model.transformer import TAPS, dense_forward, embed_tokens
from jaxinfer.weights import LoadedModel, load_model

TINY = Path(__file__).parent / "data" / "tiny"
TOKENS = np.array([[1, 7, 3, 9, 4], [2, 2, 8, 5, 6]], np.int32)  # [B, T]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model(TINY / "llama")


def _captured(model: LoadedModel, names) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    run = jax.jit(capture_intermediates(dense_forward, names), static_argnums=1)
    hidden, found = run(model.params, model.config, TOKENS)
    return np.asarray(hidden), {name: np.asarray(x) for name, x in found.items()}


def test_every_tap_is_stacked_over_layers(tiny: LoadedModel) -> None:
    config = tiny.config
    hidden, found = _captured(tiny, TAPS)
    b, t = TOKENS.shape
    ffn = tiny.params["layers"]["down_proj"].shape[-1]
    widths = {"attn_in": config.d_model, "attn_out": config.num_heads * config.head_dim,
              "mlp_in": config.d_model, "mlp_hidden": ffn, "layer_out": config.d_model}
    assert {name: x.shape for name, x in found.items()} == {  # flat tokens, as the model runs
        name: (config.num_layers, b * t, width) for name, width in widths.items()}
    np.testing.assert_array_equal(found["layer_out"][-1], hidden.reshape(b * t, -1))


def test_first_layer_taps_equal_a_hand_computation(tiny: LoadedModel) -> None:
    config, params = tiny.config, tiny.params
    layer = jax.tree.map(lambda w: w[0], params["layers"])
    eps, offset = config.norm_eps, config.norm_offset
    _, found = _captured(tiny, TAPS)
    h = embed_tokens(params, config, jnp.asarray(TOKENS).reshape(-1))  # [B * T, d]
    np.testing.assert_allclose(found["attn_in"][0], rms_norm(h, layer["attn_norm"], eps, offset),
                               rtol=1e-5, atol=1e-6)
    h = h + linear(jnp.asarray(found["attn_out"][0]), layer["o_proj"])
    x = rms_norm(h, layer["mlp_norm"], eps, offset)
    np.testing.assert_allclose(found["mlp_in"][0], x, rtol=1e-5, atol=1e-6)
    hidden = activation(linear(x, layer["gate_proj"]), config.activation) * linear(
        x, layer["up_proj"])
    np.testing.assert_allclose(found["mlp_hidden"][0], hidden, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(found["layer_out"][0], h + linear(hidden, layer["down_proj"]),
                               rtol=1e-5, atol=1e-6)


def test_only_the_asked_names_come_back(tiny: LoadedModel) -> None:
    hidden, found = _captured(tiny, ["mlp_in"])
    assert list(found) == ["mlp_in"]
    plain = jax.jit(dense_forward, static_argnums=1)
    np.testing.assert_array_equal(hidden, plain(tiny.params, tiny.config, TOKENS))


def test_nothing_is_captured_when_not_asked(tiny: LoadedModel) -> None:
    plain = jax.make_jaxpr(dense_forward, static_argnums=1)(tiny.params, tiny.config, TOKENS)
    empty = jax.make_jaxpr(capture_intermediates(dense_forward, []), static_argnums=1)(
        tiny.params, tiny.config, TOKENS)
    assert len(plain.jaxpr.outvars) == len(empty.jaxpr.outvars) == 1
    assert str(plain) == str(empty)  # the same program
    x = jnp.ones(3)
    assert tap("attn_in", x) is x  # outside a capture: the identity, nothing kept


def test_an_unknown_name_is_an_error_listing_the_taps(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match=r"\['attn_input'\] were not tapped.*'attn_in'"):
        _captured(tiny, ["attn_input"])
