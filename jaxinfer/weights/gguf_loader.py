"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package.

Quantized tensors (Q4_K, Q5_0, Q6_K, Q8_0, F16, ...) are dequantized to the
compute dtype, or, with a quantizer, converted to our int8/int4 formats. Matrices in
Q8_0, Q5_0, Q6_K and Q4_K are read from their blocks a chunk of rows at a time
(`gguf_quants`), never as a whole f32 tensor; other types go through gguf.quants' f32.
Two llama.cpp conventions are undone on the way in:
- Gemma's RMSNorm weights are stored with the +1 already added; our params
  keep the checkpoint's (1 + w) convention, so 1 is subtracted (as HF does).
- Llama-style GGUFs permute the rows of Q and K for llama.cpp's interleaved
  RoPE; we use the rotate-half layout, so the permutation is reversed (on the
  rows of the blocks, for a matrix still in its blocks).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxinfer.errors import ModelLoadError
from jaxinfer.gguf_file import GGUFFile, GGUFTensor, read_gguf
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params, check_param_shapes, stack_layers
from jaxinfer.model.quant import QuantizedWeight
from jaxinfer.weights.families import family_for_gguf
from jaxinfer.weights.gguf_quants import GGUFMatrix, can_decode, common_form
from jaxinfer.weights.quantize import Quantizer

GLOBAL_TENSORS = {"token_embd": "embed", "output_norm": "final_norm", "output": "lm_head"}

LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o_proj",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "post_ffw_norm.weight": "post_mlp_norm",
}

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file, turning every failure into a ModelLoadError naming the file."""
    return read_gguf(path)


def config_from_gguf(reader: GGUFFile, name: str | None = None) -> ModelConfig:
    """Model hyper-parameters from the GGUF metadata: what every architecture states
    the same way here, the rest by its family."""
    gguf_arch = reader.get("general.architecture")
    family = family_for_gguf(gguf_arch)

    def meta(key: str, default: Any = None) -> Any:
        value = reader.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {gguf_arch}.{key}")
        return value

    d_model, num_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    embed = _tensor_info(reader, "token_embd.weight")
    common = dict(
        vocab_size=int(embed.shape[0]),
        d_model=d_model,
        num_layers=int(meta("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", d_model // num_heads)),
        ffn_dim=int(meta("feed_forward_length")),
        max_position=int(meta("context_length")),
        norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10_000.0)),
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_ids(reader),
        pad_token_id=int(reader.get("tokenizer.ggml.padding_token_id", 0)),
        name=name or str(reader.get("general.name", "model")),
        tie_embeddings=_tensor_info(reader, "output.weight", required=False) is None,
    )
    return family.config_from_gguf(common, meta, reader)


def file_type_name(reader: GGUFFile) -> str:
    """The GGUF's storage type, e.g. "Q4_K_M"; "unknown" when the metadata lacks it."""
    file_type = reader.get("general.file_type")
    try:
        return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "unknown"


def _eos_ids(reader: GGUFFile) -> tuple[int, ...]:
    eos = reader.get("tokenizer.ggml.eos_token_id")
    return () if eos is None else (int(eos),)


def _tensor_info(reader: GGUFFile, name: str, required: bool = True) -> GGUFTensor | None:
    tensor = reader.tensors.get(name)
    if tensor is None and required:
        raise ModelLoadError(f"GGUF file lacks tensor {name!r}")
    return tensor


def load_gguf_params(
    reader: GGUFFile, config: ModelConfig, dtype: Any = np.float32,
    quantizer: Quantizer | None = None,
) -> Params:
    """Dequantize every tensor into the params pytree (numpy arrays of `dtype`).

    With a `quantizer`, each matrix is requantized as it is decoded: from its blocks
    chunk by chunk where `gguf_quants` decodes its type, else from one f32 tensor.
    """
    gguf_arch = reader.get("general.architecture")
    permute_qk = gguf_arch in family_for_gguf(gguf_arch).gguf_permuted_qk
    top: dict[str, Any] = {}
    layers: list[dict[str, Any]] = [{} for _ in range(config.num_layers)]
    for tensor in reader.tensors.values():
        target, layer_index = _target_name(tensor.name)
        if target is None:
            continue
        destination = top if layer_index is None else layers[layer_index]
        destination[target] = _load_tensor(tensor, target, config, permute_qk, dtype, quantizer)
    params: Params = {**top, "layers": stack_layers(_stackable(layers))}
    check_param_shapes(config, params)
    return params


def _stackable(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-layer weights with each tensor in one form across layers (`common_form`)."""
    for name in layers[0]:
        weights = [layer[name] for layer in layers]
        if all(isinstance(w, QuantizedWeight) for w in weights):
            for layer, weight in zip(layers, common_form(weights), strict=True):
                layer[name] = weight
    return layers


def _target_name(gguf_name: str) -> tuple[str | None, int | None]:
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match:
        return LAYER_TENSORS.get(match.group(2)), int(match.group(1))
    base = gguf_name.removesuffix(".weight")
    return GLOBAL_TENSORS.get(base), None


def _load_tensor(
    tensor: GGUFTensor, target: str, config: ModelConfig, permute_qk: bool, dtype: Any,
    quantizer: Quantizer | None,
) -> Any:
    """One tensor in its params form: a `dtype` array or the quantizer's output."""
    if can_decode(tensor) and not target.endswith("norm"):
        weight = _undo_conventions(GGUFMatrix.from_tensor(tensor), target, config, permute_qk)
    else:
        weight = _undo_conventions(_dequantize(tensor), target, config, permute_qk)
    if quantizer is not None:
        weight = quantizer(target, weight)
    elif isinstance(weight, GGUFMatrix):
        weight = weight.dequantize(dtype)
    return weight.astype(dtype, copy=False) if isinstance(weight, np.ndarray) else weight


def _dequantize(tensor: GGUFTensor) -> np.ndarray:
    try:
        return tensor.dequantize()
    except Exception as exc:  # gguf.quants raises NotImplementedError, ValueError, ...
        raise ModelLoadError(
            f"cannot dequantize GGUF tensor {tensor.name} ({tensor.qtype.name}): {exc}"
        ) from exc


def _undo_conventions(
    weight: np.ndarray | GGUFMatrix, target: str, config: ModelConfig, permute_qk: bool
) -> np.ndarray | GGUFMatrix:
    if config.norm_offset and target.endswith("norm"):
        return weight - np.float32(config.norm_offset)
    if permute_qk and target in ("q_proj", "k_proj", "q_bias", "k_bias"):
        heads = config.num_heads if target.startswith("q") else config.num_kv_heads
        if isinstance(weight, GGUFMatrix):  # a row permutation: reorder the block rows
            return weight.permute_rows(reverse_qk_permutation(np.arange(weight.shape[0]), heads))
        return reverse_qk_permutation(weight, heads)
    return weight


def reverse_qk_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half RoPE layout)."""
    half = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)
