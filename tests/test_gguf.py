"""GGUF loading: llama.cpp's naming and conventions, quantized tensors, damaged files.

Tiny GGUFs are written here from the HF fixtures (whose logits match HF), the way
llama.cpp's converter writes them: Q/K rows permuted for Llama, +1 added to
Gemma's norms. Loading them back must give exactly the HF params.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxinfer.errors import ModelLoadError
from jaxinfer.model.config import ModelConfig
from jaxinfer.weights import gguf_loader, hf

TINY = Path(__file__).parent / "data" / "tiny"

OUR_TO_GGUF = {ours: name.removesuffix(".weight").removesuffix(".bias")
               for name, ours in gguf_loader.LAYER_TENSORS.items()}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K permutation (rotate-half -> interleaved)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(path: Path, config: ModelConfig, params: dict, arch: str,
               quantize: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
               qtype: str = "Q8_0") -> None:
    """The tensors whose names contain one of `quantize` are stored as `qtype`."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.d_model)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    for name, array in [*_gguf_tensors(config, params, arch), *(extra or {}).items()]:
        _add_tensor(writer, name, array, qtype if any(q in name for q in quantize) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_tensors(config: ModelConfig, params: dict, arch: str):
    yield "token_embd.weight", params["embed"]
    yield "output_norm.weight", params["final_norm"] + config.norm_offset
    if "lm_head" in params:
        yield "output.weight", params["lm_head"]
    for ours, stacked in params["layers"].items():
        suffix = "bias" if ours.endswith("bias") else "weight"
        for index, weight in enumerate(stacked):
            if ours.endswith("norm"):
                weight = weight + config.norm_offset
            if arch == "llama" and ours in ("q_proj", "k_proj"):
                weight = llama_cpp_permute(
                    weight, config.num_heads if ours == "q_proj" else config.num_kv_heads)
            yield f"blk.{index}.{OUR_TO_GGUF[ours]}.{suffix}", weight


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray,
                qtype: str | None) -> None:
    array = np.ascontiguousarray(array, np.float32)
    if qtype is None:
        writer.add_tensor(name, array)
        return
    packed = _encode(array, qtype)
    writer.add_tensor(name, packed, raw_shape=packed.shape,
                      raw_dtype=gguf.GGMLQuantizationType[qtype])


def _load(path: Path) -> tuple[ModelConfig, dict]:
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.config_from_gguf(reader)
    return config, gguf_loader.load_gguf_params(reader, config)


def _assert_same_params(expected: dict, actual: dict, atol: float = 0.0) -> None:
    for name in expected["layers"]:
        np.testing.assert_allclose(actual["layers"][name], expected["layers"][name],
                                   atol=atol, rtol=0, err_msg=name)
    np.testing.assert_allclose(actual["embed"], expected["embed"], atol=atol, rtol=0)


def test_llama_gguf_undoes_the_qk_permutation(tmp_path: Path) -> None:
    config, params = hf.load_hf_folder(TINY / "llama")
    write_gguf(tmp_path / "llama.gguf", config, params, "llama")
    loaded_config, loaded = _load(tmp_path / "llama.gguf")
    _assert_same_params(params, loaded)
    assert loaded_config.num_kv_heads == 2 and not loaded_config.tie_embeddings
    assert not np.array_equal(params["layers"]["q_proj"],
                              llama_cpp_permute(params["layers"]["q_proj"][0], 4))


def test_qwen2_gguf_with_biases_and_q8_0_tensors(tmp_path: Path) -> None:
    config, params = hf.load_hf_folder(TINY / "qwen2")
    write_gguf(tmp_path / "qwen2.gguf", config, params, "qwen2", quantize=("ffn_",))
    loaded_config, loaded = _load(tmp_path / "qwen2.gguf")
    assert loaded_config.qkv_bias and loaded_config.tie_embeddings
    np.testing.assert_array_equal(loaded["layers"]["q_bias"], params["layers"]["q_bias"])
    # Q8_0 keeps one scale per 32 values: error at most half a step of 127 levels
    step = np.abs(params["layers"]["up_proj"]).max() / 127
    np.testing.assert_allclose(loaded["layers"]["up_proj"], params["layers"]["up_proj"],
                               atol=step, rtol=0)
    assert not np.array_equal(loaded["layers"]["up_proj"], params["layers"]["up_proj"])


def test_gemma3_gguf_norms_drop_the_added_one(tmp_path: Path) -> None:
    config, params = hf.load_hf_folder(TINY / "gemma3")
    write_gguf(tmp_path / "gemma3.gguf", config, params, "gemma3")
    loaded_config, loaded = _load(tmp_path / "gemma3.gguf")
    assert loaded_config.norm_offset == 1.0 and loaded_config.sandwich_norms
    _assert_same_params(params, loaded, atol=1e-6)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        gguf_loader.open_gguf(tmp_path / "nope.gguf")


def test_garbage_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        gguf_loader.open_gguf(path)


def test_truncated_gguf_is_rejected(tmp_path: Path) -> None:
    config, params = hf.load_hf_folder(TINY / "qwen2")
    full = tmp_path / "full.gguf"
    write_gguf(full, config, params, "qwen2")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(ModelLoadError):
        _load(cut)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    config, params = hf.load_hf_folder(TINY / "qwen2")
    path = tmp_path / "falcon.gguf"
    write_gguf(path, config, params, "falcon")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'falcon'"):
        _load(path)


def test_reader_agrees_with_the_gguf_package(tmp_path: Path) -> None:
    config, params = hf.load_hf_folder(TINY / "qwen2")
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, config, params, "qwen2", quantize=("ffn_",))
    ours = gguf_loader.open_gguf(path)
    theirs = gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's pseudo-fields for the header
            continue
        expected = field.contents()
        assert np.array_equal(np.asarray(ours.get(key)), np.asarray(expected)), key
    for tensor in theirs.tensors:
        np.testing.assert_array_equal(
            ours.tensors[tensor.name].dequantize(),
            gguf.quants.dequantize(tensor.data, tensor.tensor_type), err_msg=tensor.name)


def test_a_gguf_without_a_usable_tokenizer_serves_ids_and_takes_one_from_a_folder(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        tiny_llama_with_tokenizer: Path) -> None:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.errors import ConfigError
    from jaxinfer.weights import load_model

    config, params = hf.load_hf_folder(TINY / "llama")
    write_gguf(tmp_path / "bare.gguf", config, params, "llama")  # no tokenizer.ggml.*
    with caplog.at_level("WARNING"):
        bare = load_model(tmp_path / "bare.gguf")
    assert bare.tokenizer is None
    assert "bare.gguf: loaded without a tokenizer" in caplog.text
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm = LLM(loaded=bare, max_model_len=64)
    assert len(llm.generate(prompt_token_ids=[[1, 5, 9]], sampling_params=greedy)[0]
               .token_ids) == 4
    with pytest.raises(ConfigError, match="without a tokenizer"):
        llm.generate("hello world", greedy)

    tokenizer_json = tiny_llama_with_tokenizer / "tokenizer.json"
    given = load_model(tmp_path / "bare.gguf", tokenizer=tokenizer_json)
    ids = given.tokenizer.encode("hello world")
    llm = LLM(loaded=given, max_model_len=64)
    assert llm.generate("hello world", greedy)[0].token_ids == llm.generate(
        prompt_token_ids=[ids], sampling_params=greedy)[0].token_ids
    with pytest.raises(ModelLoadError, match="not a Hugging Face folder"):
        load_model(tmp_path / "bare.gguf", tokenizer=tmp_path / "nowhere")


def test_a_rope_freqs_tensor_gives_llama3_scaling(tmp_path: Path) -> None:
    """llama.cpp writes Llama 3.1+ RoPE scaling as per-frequency factors (rope_freqs)."""
    from jaxinfer.model.config import RopeScaling
    from jaxinfer.model.layers import rope_inv_freq

    config, params = hf.load_hf_folder(TINY / "llama")
    llama3 = RopeScaling("llama3", factor=8.0, original_max_position=32)  # all three bands
    plain = np.asarray(rope_inv_freq(config.head_dim, config.rope_theta, None))
    scaled = np.asarray(rope_inv_freq(config.head_dim, config.rope_theta, llama3))
    assert len(set(np.round(plain / scaled, 4))) > 2  # unscaled, smoothed and scaled bands
    write_gguf(tmp_path / "llama31.gguf", config, params, "llama",
               extra={"rope_freqs.weight": plain / scaled})
    loaded, _ = _load(tmp_path / "llama31.gguf")
    assert loaded.rope_scaling.kind == "factors"
    np.testing.assert_allclose(rope_inv_freq(loaded.head_dim, loaded.rope_theta,
                                             loaded.rope_scaling), scaled, rtol=1e-6)
    write_gguf(tmp_path / "bad.gguf", config, params, "llama",
               extra={"rope_freqs.weight": np.ones(3, np.float32)})
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight has 3 values"):
        _load(tmp_path / "bad.gguf")


def test_a_declared_sliding_window_is_kept(tmp_path: Path) -> None:
    """Mistral-style: a window in the GGUF makes every layer a sliding-window layer."""
    import dataclasses

    config, params = hf.load_hf_folder(TINY / "llama")
    windowed = dataclasses.replace(config, sliding_window=8,
                                   layer_types=("local",) * config.num_layers)
    write_gguf(tmp_path / "mistral.gguf", windowed, params, "llama")
    loaded, _ = _load(tmp_path / "mistral.gguf")
    assert loaded.sliding_window == 8 and set(loaded.layer_types) == {"local"}
    write_gguf(tmp_path / "llama.gguf", config, params, "llama")
    assert _load(tmp_path / "llama.gguf")[0].sliding_window is None


def test_qwen3_gguf_keeps_its_qk_norms(tmp_path: Path) -> None:
    config, params = hf.load_hf_folder(TINY / "qwen3")
    write_gguf(tmp_path / "qwen3.gguf", config, params, "qwen3")
    loaded_config, loaded = _load(tmp_path / "qwen3.gguf")
    assert loaded_config.qk_norm and not loaded_config.qkv_bias and loaded_config.head_dim == 32
    _assert_same_params(params, loaded)
    np.testing.assert_array_equal(loaded["layers"]["k_norm"], params["layers"]["k_norm"])


# GGML block layouts: (bytes per 256-value block, byte offsets of its f16 scale fields)
_K_BLOCKS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q5_K": (176, (0, 2))}


def _encode(array: np.ndarray, qtype: str) -> np.ndarray:
    """Raw rows of `qtype` for an f32 matrix: gguf-py's quantizer, or for K-quants (which
    gguf-py cannot write) random quants with small, finite scales."""
    if qtype not in _K_BLOCKS:
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType[qtype])
    size, scale_offsets = _K_BLOCKS[qtype]
    rows, cols = array.shape
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // 256, size), np.uint8)
    for offset in scale_offsets:
        raw[..., offset:offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "BF16"])
def test_every_common_quant_type_loads(tmp_path: Path, qtype: str) -> None:
    """llama.cpp's presets mix these: each loads (through gguf-py's dequantizer where we
    have no integer path) to exactly the values the file stores."""
    import dataclasses

    import jax

    from jaxinfer.weights.dummy import dummy_params

    config = dataclasses.replace(hf.load_hf_folder(TINY / "llama")[0], d_model=256,
                                 ffn_dim=256, num_heads=4, num_kv_heads=2, head_dim=64)
    params = jax.tree.map(np.asarray, dummy_params(config))
    path = tmp_path / f"{qtype}.gguf"
    write_gguf(path, config, params, "llama", quantize=("ffn_up",), qtype=qtype)
    stored = gguf_loader.open_gguf(path).tensors
    _, loaded = _load(path)
    for layer in range(config.num_layers):
        tensor = stored[f"blk.{layer}.ffn_up.weight"]
        assert tensor.qtype.name == qtype
        np.testing.assert_array_equal(loaded["layers"]["up_proj"][layer], tensor.dequantize())


def test_a_damaged_or_unsupported_gguf_is_one_line_naming_the_file(tmp_path: Path) -> None:
    from jaxinfer.weights import load_model

    config, params = hf.load_hf_folder(TINY / "llama")
    missing = {**params, "layers": {k: v for k, v in params["layers"].items() if k != "up_proj"}}
    write_gguf(tmp_path / "no_up.gguf", config, missing, "llama")
    with pytest.raises(ModelLoadError) as info:
        load_model(tmp_path / "no_up.gguf")
    assert str(tmp_path / "no_up.gguf") in str(info.value) and "\n" not in str(info.value)
    assert "up_proj" in str(info.value)
    write_gguf(tmp_path / "rwkv.gguf", config, params, "rwkv6")
    with pytest.raises(ModelLoadError, match=r"rwkv\.gguf: unsupported GGUF architecture "
                                             r"'rwkv6'; supported: gemma3, llama"):
        load_model(tmp_path / "rwkv.gguf")
