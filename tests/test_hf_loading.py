"""Hugging Face folder loading: config translation, weight mapping, and logits
matching transformers on tiny random models (tests/data/tiny, made by
scripts/make_tiny_fixtures.py; no torch needed here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from helpers import full_logits
from safetensors.numpy import load_file, save_file

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import RopeScaling
from jaxinfer.weights.hf import config_from_hf, load_hf_folder

TINY = Path(__file__).parent / "data" / "tiny"

EXPECTED_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {
        "architecture": "llama", "vocab_size": 256, "d_model": 64, "num_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "ffn_dim": 128,
        "norm_eps": 1e-5, "norm_offset": 0.0, "activation": "silu", "tie_embeddings": False,
        "qkv_bias": False, "qk_norm": False, "sandwich_norms": False,
        "layer_types": ("global", "global"), "bos_token_id": 1, "eos_token_ids": (2, 3),
        "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 32),
    },
    "qwen2": {
        "architecture": "llama", "vocab_size": 256, "d_model": 64, "head_dim": 16,
        "qkv_bias": True, "tie_embeddings": True, "rope_theta": 1e6, "rope_scaling": None,
        "sliding_window": None, "layer_types": ("global", "global"), "eos_token_ids": (6,),
    },
    "qwen3": {
        "architecture": "llama", "vocab_size": 256, "d_model": 64, "head_dim": 32,
        "qkv_bias": False, "qk_norm": True, "tie_embeddings": True, "rope_theta": 1e6,
        "norm_offset": 0.0, "sliding_window": None, "layer_types": ("global", "global"),
    },
    "mistral": {
        "architecture": "llama", "head_dim": 16, "qkv_bias": False, "qk_norm": False,
        "tie_embeddings": False, "sliding_window": 4, "layer_types": ("local", "local"),
        "eos_token_ids": (2,),
    },
    "gemma3": {
        "architecture": "gemma3", "vocab_size": 128, "num_layers": 6, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 16, "ffn_dim": 64, "activation": "gelu_tanh",
        "norm_offset": 1.0, "scale_embeddings": True, "sandwich_norms": True, "qk_norm": True,
        "query_pre_attn_scalar": 24.0, "rope_theta": 1e6, "rope_local_theta": 1e4,
        "rope_scaling": RopeScaling("linear", 2.0), "sliding_window": 4,
        "layer_types": ("local", "local", "global", "local", "local", "global"),
        "tie_embeddings": True, "eos_token_ids": (1, 106), "bos_token_id": 2,
        "attn_logit_softcap": None, "final_logit_softcap": None,
    },
}


def _copy_fixture(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(TINY / name, dest)
    return dest


# ----------------------------------------------------------------------------- fixtures vs HF


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIG))
def test_config_fields(name: str) -> None:
    config, _ = load_hf_folder(TINY / name)
    actual = {key: getattr(config, key) for key in EXPECTED_CONFIG[name]}
    assert actual == EXPECTED_CONFIG[name]
    assert config.name == name


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIG))
def test_logits_match_transformers(name: str) -> None:
    config, params = load_hf_folder(TINY / name)
    expected = np.load(TINY / name / "expected.npz")
    tokens, want = expected["tokens"], expected["logits"]  # [2, 12], [2, 12, V]
    got = np.asarray(full_logits(params, config, tokens))
    assert got.shape == want.shape
    rel = np.abs(got - want).max() / (want.max() - want.min())
    assert rel < 1e-4, f"{name}: max |diff| / spread = {rel:.2e}"


def test_sharded_and_untied_head_loaded() -> None:
    _, params = load_hf_folder(TINY / "llama")
    assert "lm_head" in params
    assert not np.array_equal(params["lm_head"], params["embed"])
    assert params["layers"]["q_proj"].shape == (2, 128, 64)  # [L, heads*head_dim, d_model]
    assert params["layers"]["q_proj"].dtype == np.float32


def test_tied_model_has_no_head() -> None:
    _, params = load_hf_folder(TINY / "qwen2")
    assert "lm_head" not in params
    assert params["layers"]["q_bias"].shape == (2, 64)


# ----------------------------------------------------------------------------- dtypes, layouts


def test_bf16_checkpoint_converted(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file(bf16, folder / "model.safetensors")
    _, as_f32 = load_hf_folder(folder)
    _, as_bf16 = load_hf_folder(folder, dtype=ml_dtypes.bfloat16)
    want = bf16["model.layers.1.self_attn.k_proj.weight"].astype(np.float32)
    np.testing.assert_array_equal(as_f32["layers"]["k_proj"][1], want)
    assert as_f32["embed"].dtype == np.float32
    assert as_bf16["embed"].dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize(
    ("prefix", "head"),
    [("language_model.model.", "language_model.lm_head.weight"),
     ("model.language_model.", "lm_head.weight")],
)
def test_multimodal_gemma3_prefixes(tmp_path: Path, prefix: str, head: str) -> None:
    text_config = json.loads((TINY / "gemma3" / "config.json").read_text())
    folder = tmp_path / "mm"
    folder.mkdir()
    top = {"model_type": "gemma3", "text_config": text_config, "eos_token_id": [1, 106]}
    (folder / "config.json").write_text(json.dumps(top))
    tensors = load_file(TINY / "gemma3" / "model.safetensors")
    renamed = {prefix + k.removeprefix("model."): v for k, v in tensors.items()}
    renamed[head] = tensors["model.embed_tokens.weight"]  # tied head saved anyway: dropped
    renamed["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    save_file(renamed, folder / "model.safetensors")
    config, params = load_hf_folder(folder)
    want_config, want = load_hf_folder(TINY / "gemma3")
    assert config.layer_types == want_config.layer_types
    assert "lm_head" not in params
    for key, value in want["layers"].items():
        np.testing.assert_array_equal(params["layers"][key], value)


def test_tied_head_that_differs_is_an_error(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="differs from embed_tokens"):
        load_hf_folder(folder)


# ----------------------------------------------------------------------------- errors


def test_missing_config_json(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json") as err:
        load_hf_folder(folder)
    assert str(folder) in str(err.value)


def test_unsupported_model_type(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "mamba"}))
    supported = "gemma3, gemma3_text, llama, mistral, qwen2, qwen3"
    with pytest.raises(ModelLoadError, match=rf"'mamba'.*supported: {supported}"):
        load_hf_folder(folder)


def test_truncated_safetensors(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated") as err:
        load_hf_folder(folder)
    assert str(file) in str(err.value)


def test_missing_tensor_named(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.bias"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor\(s\): model\.layers\.1\.self_attn"):
        load_hf_folder(folder)


def test_misshapen_tensor_named(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.v_proj.bias"] = np.zeros(5, np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"v_proj\.bias has shape \(5,\), expected \(32,\)"):
        load_hf_folder(folder)


def test_missing_shard_file(tmp_path: Path) -> None:
    folder = _copy_fixture("llama", tmp_path)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"00002-of-00003\.safetensors, which is missing"):
        load_hf_folder(folder)


def test_unused_tensor_is_an_error(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"does not use: model\.layers\.0\.self_attn\.o_proj"):
        load_hf_folder(folder)


def test_no_safetensors_files(tmp_path: Path) -> None:
    folder = _copy_fixture("qwen2", tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files"):
        load_hf_folder(folder)


# ----------------------------------------------------------------------------- config_from_hf


LLAMA_BASE: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "eos_token_id": 7,
}


def test_legacy_llama3_rope_scaling_and_defaults() -> None:
    hf = LLAMA_BASE | {
        "rope_theta": 500_000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }
    config = config_from_hf(hf, "l3")
    assert config.head_dim == 16 and config.num_kv_heads == 4  # hidden/heads, MHA default
    assert config.rope_theta == 500_000.0
    assert config.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert config.eos_token_ids == (7,) and not config.tie_embeddings


def test_linear_rope_scaling_old_type_key() -> None:
    config = config_from_hf(LLAMA_BASE | {"rope_scaling": {"type": "linear", "factor": 4.0}}, "x")
    assert config.rope_scaling == RopeScaling("linear", 4.0)


def test_unsupported_rope_type() -> None:
    with pytest.raises(ModelLoadError, match="'yarn'"):
        config_from_hf(LLAMA_BASE | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "x")


def test_per_frequency_rope_factors_are_checked() -> None:
    from jaxinfer.errors import ConfigError
    from jaxinfer.model.config import ModelConfig

    factors = RopeScaling("factors", factors=[1.0, 2.0])  # a list, as a TOML file gives it
    assert factors.factors == (1.0, 2.0) and hash(factors)
    for bad in ({"kind": "factors"}, {"kind": "linear", "factor": 2.0, "factors": (1.0,)},
                {"kind": "factors", "factors": (1.0, -2.0)}):
        with pytest.raises(ConfigError, match=r"rope_scaling\.factors"):
            RopeScaling(**bad)
    config = config_from_hf(LLAMA_BASE, "x")
    scaled = ModelConfig.from_dict({**config.to_dict(), "rope_scaling": {
        "kind": "factors", "factors": [1.0] * (config.head_dim // 2)}})
    assert ModelConfig.from_dict(scaled.to_dict()) == scaled


def test_missing_required_key() -> None:
    hf = {k: v for k, v in LLAMA_BASE.items() if k != "hidden_size"}
    with pytest.raises(ModelLoadError, match="'hidden_size'"):
        config_from_hf(hf, "x")


def test_mistral_sliding_window_all_local() -> None:
    config = config_from_hf(LLAMA_BASE | {"model_type": "mistral", "sliding_window": 32}, "m")
    assert config.layer_types == ("local", "local") and config.sliding_window == 32
    config = config_from_hf(LLAMA_BASE | {"model_type": "mistral", "sliding_window": None}, "m")
    assert config.layer_types == ("global", "global") and config.sliding_window is None


def test_qwen2_sliding_window_only_when_enabled() -> None:
    hf = LLAMA_BASE | {"model_type": "qwen2", "sliding_window": 32, "max_window_layers": 1}
    assert config_from_hf(hf, "q").layer_types == ("global", "global")
    config = config_from_hf(hf | {"use_sliding_window": True}, "q")
    assert config.layer_types == ("global", "local") and config.sliding_window == 32


def test_gemma3_multimodal_legacy_config() -> None:
    """A Hub gemma-3-4b style config: sparse text_config, rope_scaling, defaults."""
    hf = {
        "model_type": "gemma3", "eos_token_id": [1, 106],
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
            "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
        },
    }
    config = config_from_hf(hf, "gemma-3-4b")
    assert config.head_dim == 256 and config.query_pre_attn_scalar == 256.0
    assert config.rope_theta == 1e6 and config.local_theta == 1e4
    assert config.rope_scaling == RopeScaling("linear", 8.0)
    assert config.layer_types[:6] == ("local",) * 5 + ("global",)
    assert config.eos_token_ids == (1, 106) and config.tie_embeddings
    assert config.vocab_size == 262_208


def test_gemma3_sliding_window_pattern() -> None:
    hf = {"model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window_pattern": 2,
          "rope_local_base_freq": 5000.0, "query_pre_attn_scalar": 64}
    config = config_from_hf(hf, "g")
    assert config.layer_types == ("local", "global", "local", "global")
    assert config.local_theta == 5000.0 and config.attn_scale == 1 / 8
