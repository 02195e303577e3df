"""Hugging Face checkpoints: a folder with config.json and *.safetensors.

`config_from_hf` turns a transformers config dict (Llama, Mistral, Qwen2,
Gemma 3 text or multimodal) into our ModelConfig; `load_hf_folder` reads the
safetensors files (one file, or shards listed in model.safetensors.index.json)
into the params pytree.

The mapping is driven by the config: for every weight `param_shapes(config)`
expects, one table gives the HF tensor name, so a missing tensor is reported by
its HF name. HF's nn.Linear stores [out, in] like our params, so no matrix is
transposed, and Gemma's norms keep HF's (1 + w) convention (norm_offset 1.0).
The one naming difference between the families is `post_attention_layernorm`:
Llama's pre-MLP norm (our `mlp_norm`) but Gemma 3's sandwich norm after
attention (our `post_attn_norm`; its pre-MLP norm is `pre_feedforward_layernorm`).

Multimodal Gemma 3 folders hold the text model under `language_model.model.`
(Hub layout) or `model.language_model.` (transformers >= 4.52); tensors outside
the text model (vision tower, projector) are not read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401 - registers numpy's bfloat16, which safetensors' numpy API needs
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import LayerType, ModelConfig, RopeScaling, gemma3_layer_types
from jaxinfer.model.params import Params, check_param_shapes, layer_param_shapes, stack_layers

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")
_QWEN = ("qwen2", "qwen3")

# Values transformers assumes when config.json omits a key (per model_type).
_LLAMA_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10_000.0,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_DEFAULTS,
    "mistral": _LLAMA_DEFAULTS | {"max_position_embeddings": 131_072, "sliding_window": 4096},
    "qwen2": _LLAMA_DEFAULTS | {"max_position_embeddings": 32_768, "max_window_layers": 28},
    "qwen3": _LLAMA_DEFAULTS | {"max_position_embeddings": 40_960, "max_window_layers": 28},
    "gemma3_text": {  # Gemma3TextConfig; multimodal text_configs omit most of these
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    },
}

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_LAYER_KINDS: dict[str, LayerType] = {"full_attention": "global", "sliding_attention": "local"}

# Our layer weight name -> HF name inside `layers.{i}.`; the only per-architecture code.
_COMMON_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
HF_LAYER_NAMES: dict[str, dict[str, str]] = {
    "llama": _COMMON_LAYER_NAMES | {"mlp_norm": "post_attention_layernorm.weight"},
    "gemma3": _COMMON_LAYER_NAMES | {
        "post_attn_norm": "post_attention_layernorm.weight",
        "mlp_norm": "pre_feedforward_layernorm.weight",
        "post_mlp_norm": "post_feedforward_layernorm.weight",
    },
}
HF_TOP_NAMES = {"embed": "embed_tokens.weight", "final_norm": "norm.weight"}

# (prefix of the text model, name of the LM head), tried in order; "" (bare names) last.
_LAYOUTS: tuple[tuple[str, str], ...] = (
    ("model.", "lm_head.weight"),
    ("model.language_model.", "lm_head.weight"),
    ("language_model.model.", "language_model.lm_head.weight"),
    ("", "lm_head.weight"),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved

# Where a params leaf goes: (layer index or None for top-level, our name).
ParamKey = tuple[int | None, str]


# ----------------------------------------------------------------------------- config


def config_from_hf(hf_config: dict[str, Any], name: str) -> ModelConfig:
    """Translate a transformers config.json dict into a ModelConfig."""
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported Hugging Face model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "gemma3":
        return _gemma3_config(_multimodal_text_config(hf_config), name)
    hf = HF_DEFAULTS[model_type] | hf_config
    if model_type == "gemma3_text":
        return _gemma3_config(hf, name)
    return _llama_config(hf, model_type, name)


def _multimodal_text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Gemma3ForConditionalGeneration: the text model's settings, defaults filled in."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("gemma3 (multimodal) config.json has no 'text_config' dict")
    # Token ids and embedding tying live at the top level of multimodal configs.
    top = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                      "tie_word_embeddings") if hf_config.get(k) is not None}
    return HF_DEFAULTS["gemma3_text"] | text | top


def _gemma3_config(hf: dict[str, Any], name: str) -> ModelConfig:
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError("Gemma 3 with use_bidirectional_attention (an encoder) is unsupported")
    _reject_biases(hf, "gemma3", ("attention_bias",))
    global_theta, global_scaling = _rope_settings(hf, "full_attention", hf["rope_theta"])
    local_theta, local_scaling = _rope_settings(hf, "sliding_attention", hf["rope_local_base_freq"])
    if local_scaling is not None:
        raise ModelLoadError("RoPE scaling on Gemma 3 sliding-window layers is unsupported")
    return ModelConfig(
        architecture="gemma3", **_common_fields(hf, name),
        rope_theta=global_theta, rope_local_theta=local_theta, rope_scaling=global_scaling,
        sliding_window=hf["sliding_window"], layer_types=_gemma3_layer_types(hf),
        query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]), qk_norm=True,
        sandwich_norms=True, activation=_activation(hf.get("hidden_activation")),
        norm_offset=1.0, scale_embeddings=True,
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )


def _llama_config(hf: dict[str, Any], model_type: str, name: str) -> ModelConfig:
    qkv_bias = model_type == "qwen2"  # Qwen2 always has q/k/v biases, never an o bias
    if not qkv_bias:
        _reject_biases(hf, model_type, ("attention_bias", "mlp_bias"))
    theta, scaling = _rope_settings(hf, None, hf["rope_theta"])
    layer_types = _llama_layer_types(hf, model_type)
    return ModelConfig(
        architecture="llama", **_common_fields(hf, name),
        rope_theta=theta, rope_scaling=scaling, layer_types=layer_types,
        sliding_window=hf.get("sliding_window") if "local" in layer_types else None,
        qkv_bias=qkv_bias, activation=_activation(hf.get("hidden_act")),
        qk_norm=model_type == "qwen3",  # per-head RMSNorm of q and k before RoPE
    )


def _common_fields(hf: dict[str, Any], name: str) -> dict[str, Any]:
    """The fields every family reads the same way."""
    heads = _required(hf, "num_attention_heads")
    eos = hf.get("eos_token_id")
    return {
        "vocab_size": _required(hf, "vocab_size"),
        "d_model": _required(hf, "hidden_size"),
        "num_layers": _required(hf, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or _required(hf, "hidden_size") // heads,
        "ffn_dim": _required(hf, "intermediate_size"),
        "max_position": _required(hf, "max_position_embeddings"),
        "norm_eps": float(hf["rms_norm_eps"]),
        "tie_embeddings": bool(hf["tie_word_embeddings"]),
        "bos_token_id": hf.get("bos_token_id"),
        "eos_token_ids": () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        "pad_token_id": hf.get("pad_token_id") or 0,
        "name": name,
        "extra": {"hf_model_type": hf["model_type"]},
    }


def _required(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ModelLoadError(f"config.json lacks {key!r} (model_type {hf.get('model_type')!r})")
    return hf[key]


def _reject_biases(hf: dict[str, Any], model_type: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if hf.get(key):
            raise ModelLoadError(f"{model_type} with {key}=true is unsupported (no such params)")


def _activation(hf_name: str | None) -> str:
    if hf_name not in _ACTIVATIONS:
        raise ModelLoadError(
            f"unsupported activation {hf_name!r}; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[hf_name]


def _rope_settings(
    hf: dict[str, Any], layer_kind: str | None, legacy_theta: float
) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) for one layer kind from `rope_parameters` (transformers 5,
    keyed by layer type for Gemma 3) or the older `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and layer_kind is not None and layer_kind in params:
        params = params[layer_kind]
    if isinstance(params, dict):
        return float(params.get("rope_theta", legacy_theta)), _rope_scaling(params)
    scaling = hf.get("rope_scaling") if layer_kind != "sliding_attention" else None
    return float(legacy_theta), _rope_scaling(scaling or {})


def _rope_scaling(params: dict[str, Any]) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3", float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")


def _hf_layer_types(hf: dict[str, Any]) -> tuple[LayerType, ...]:
    unknown = sorted(set(hf["layer_types"]) - _LAYER_KINDS.keys())
    if unknown:
        raise ModelLoadError(f"unsupported layer_types {unknown}; supported: {list(_LAYER_KINDS)}")
    return tuple(_LAYER_KINDS[kind] for kind in hf["layer_types"])


def _gemma3_layer_types(hf: dict[str, Any]) -> tuple[LayerType, ...]:
    if hf.get("layer_types"):
        return _hf_layer_types(hf)
    pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
    return gemma3_layer_types(hf["num_hidden_layers"], pattern)


def _llama_layer_types(hf: dict[str, Any], model_type: str) -> tuple[LayerType, ...]:
    """Llama: all global. Mistral: all local when sliding_window is set. Qwen2/3: local
    from layer max_window_layers on, and only when use_sliding_window."""
    num_layers = _required(hf, "num_hidden_layers")
    if model_type in _QWEN and not hf.get("use_sliding_window"):
        return ("global",) * num_layers
    if hf.get("layer_types"):
        return _hf_layer_types(hf)
    if model_type == "mistral" and hf.get("sliding_window"):
        return ("local",) * num_layers
    if model_type in _QWEN:
        first = hf["max_window_layers"]
        return tuple("local" if i >= first else "global" for i in range(num_layers))
    return ("global",) * num_layers


# ----------------------------------------------------------------------------- weights


def load_hf_folder(path: str | Path, dtype: Any = np.float32) -> tuple[ModelConfig, Params]:
    """Read a HF model folder into (config, params) with numpy arrays of `dtype`."""
    folder = Path(path)
    config = config_from_hf(read_json(folder / "config.json"), name=folder.resolve().name)
    index = tensor_index(folder)
    prefix, head_name = _find_layout(index, folder)
    wanted = _wanted_tensors(config, prefix, head_name)
    optional = {head_name} if config.tie_embeddings else set()
    _check_names(index, wanted, optional, prefix, folder)
    present = {name: key for name, key in wanted.items() if name in index}
    tensors = _read_tensors(present, index, dtype)
    _check_tensor_shapes(config, present, tensors, folder)
    params = _assemble(config, tensors, folder)
    check_param_shapes(config, params)
    return config, params


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} not found (a Hugging Face model folder needs config.json)")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from err


def tensor_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path} has no 'weight_map' dict")
        files = {name: folder / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise ModelLoadError(f"{index_path} lists {file.name}, which is missing")
        return files
    return _scan_files(folder)


def _scan_files(folder: Path) -> dict[str, Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    index: dict[str, Path] = {}
    for file in files:
        for name in _tensor_names(file):
            if name in index:
                raise ModelLoadError(f"tensor {name} is in both {index[name]} and {file}")
            index[name] = file
    return index


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="numpy") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as err:
        raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {err}") from err


def _find_layout(index: dict[str, Path], folder: Path) -> tuple[str, str]:
    for prefix, head_name in _LAYOUTS:
        if prefix + HF_TOP_NAMES["embed"] in index:
            return prefix, head_name
    raise ModelLoadError(
        f"no embedding tensor in {folder}: looked for "
        + ", ".join(prefix + HF_TOP_NAMES["embed"] for prefix, _ in _LAYOUTS)
    )


def _wanted_tensors(config: ModelConfig, prefix: str, head_name: str) -> dict[str, ParamKey]:
    """HF tensor name -> params key, for every weight the config needs (plus a tied
    model's lm_head, read if present so that it can be checked and dropped)."""
    names = HF_LAYER_NAMES[config.architecture]
    wanted: dict[str, ParamKey] = {prefix + hf: (None, ours) for ours, hf in HF_TOP_NAMES.items()}
    wanted[head_name] = (None, "lm_head")
    for i in range(config.num_layers):
        for ours in layer_param_shapes(config):
            wanted[f"{prefix}layers.{i}.{names[ours]}"] = (i, ours)
    return wanted


def _check_names(
    index: dict[str, Path], wanted: dict[str, ParamKey], optional: set[str], prefix: str,
    folder: Path,
) -> None:
    """Every needed tensor present; nothing in the text model left unread."""
    missing = [name for name in wanted if name not in index and name not in optional]
    if missing:
        raise ModelLoadError(f"{folder} lacks {len(missing)} tensor(s): {_short_list(missing)}")
    unused = [
        name for name in index
        if name.startswith(prefix) and name not in wanted and not name.endswith(_IGNORED_SUFFIXES)
    ]
    if unused:
        raise ModelLoadError(
            f"{folder} has {len(unused)} tensor(s) this config does not use: {_short_list(unused)}"
        )


def _short_list(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _read_tensors(
    wanted: dict[str, ParamKey], index: dict[str, Path], dtype: Any
) -> dict[ParamKey, np.ndarray]:
    """Read the wanted tensors, one file open at a time, converted to `dtype`."""
    out: dict[ParamKey, np.ndarray] = {}
    for file in sorted({index[name] for name in wanted}):
        names = [name for name in wanted if index[name] == file]
        try:
            with safe_open(file, framework="numpy") as handle:
                for name in names:
                    out[wanted[name]] = np.asarray(handle.get_tensor(name), dtype=dtype)
        except (SafetensorError, OSError) as err:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {err}") from err
    return out


def _check_tensor_shapes(
    config: ModelConfig, names: dict[str, ParamKey], tensors: dict[ParamKey, np.ndarray],
    folder: Path,
) -> None:
    """Name each misshapen tensor by its HF name (before stacking hides which layer)."""
    wrong = [
        f"{name} has shape {tensors[key].shape}, expected {_param_shape(config, key)}"
        for name, key in names.items()
        if tensors[key].shape != _param_shape(config, key)
    ]
    if wrong:
        raise ModelLoadError(f"{folder} does not match its config.json: {_short_list(wrong)}")


def _param_shape(config: ModelConfig, key: ParamKey) -> tuple[int, ...]:
    layer, ours = key
    if layer is not None:
        return layer_param_shapes(config)[ours]
    return (config.d_model,) if ours == "final_norm" else (config.vocab_size, config.d_model)


def _assemble(config: ModelConfig, tensors: dict[ParamKey, np.ndarray], folder: Path) -> Params:
    """Param keys -> the params pytree with [L, ...] stacked layers."""
    per_layer = [
        {ours: tensors[(i, ours)] for ours in layer_param_shapes(config)}
        for i in range(config.num_layers)
    ]
    params: Params = {
        "embed": tensors[(None, "embed")],  # [vocab, d_model]
        "final_norm": tensors[(None, "final_norm")],  # [d_model]
        "layers": stack_layers(per_layer),
    }
    head = tensors.get((None, "lm_head"))  # [vocab, d_model]; absent only when tied
    if not config.tie_embeddings:
        params["lm_head"] = head
    elif head is not None and not np.array_equal(head, params["embed"]):
        raise ModelLoadError(
            f"{folder}: config ties embeddings (tie_word_embeddings) but lm_head.weight "
            "differs from embed_tokens.weight"
        )
    return params
