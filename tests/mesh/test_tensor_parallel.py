"""Tensor parallelism on 8 CPU devices: the split model generates what one device does.

Tiny models cover both KV layouts (the tiny Llama and Gemma 3 have 2 KV heads:
TP=2 splits them, TP=4 repeats each for two shards), every weight format, the
int8 KV cache and the Pallas kernels under shard_map. The real Gemma 3 270M (one
KV head) must give HF's greedy tokens at TP=2 and TP=4. The compiled step must
hold the Megatron layout's collectives and never gather the vocabulary.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxinfer import LLM, ConfigError, SamplingParams
from jaxinfer.parallel.mesh import make_mesh
from jaxinfer.weights import load_model

TINY = Path(__file__).parents[1] / "data" / "tiny"
PROMPTS = [[5, 17, 99, 3, 42, 7], [11, 12, 13], [100, 1, 60, 60, 60, 60, 60, 2, 9, 8, 7, 6],
           [5, 17, 99, 3, 42, 7, 8, 9, 10]]  # the last shares a cached prefix with the first
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def generate(model, prompts=PROMPTS, params=GREEDY, **settings) -> list[list[int]]:
    base = dict(max_model_len=64, max_num_seqs=4, block_size=4, max_num_batched_tokens=16)
    llm = LLM(loaded=model, **(base | settings))
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def llama():
    return load_model(TINY / "llama")


@pytest.fixture(scope="module")
def gemma3_tiny():
    return load_model(TINY / "gemma3")


@pytest.fixture(scope="module")
def llama_single(llama) -> list[list[int]]:
    return generate(llama)


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_split_generates_what_one_device_does(llama, llama_single, tp: int) -> None:
    assert generate(llama, tensor_parallel_size=tp) == llama_single


@pytest.mark.parametrize(("tp", "kv_cache_dtype"), [(2, "auto"), (4, "int8")])
def test_gemma3_windows_and_int8_cache_split(gemma3_tiny, tp: int, kv_cache_dtype: str) -> None:
    want = generate(gemma3_tiny, kv_cache_dtype=kv_cache_dtype)
    assert generate(gemma3_tiny, tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype) == want


@pytest.mark.parametrize("quantization", ["int8", "w8a8", "int4", "int4-awq"])
def test_every_weight_format_splits(quantization: str) -> None:
    model = load_model(TINY / "llama", quantization=quantization, quant_group_size=32)
    assert generate(model, tensor_parallel_size=2) == generate(model)


def test_a_gguf_in_its_own_blocks_splits(tmp_path: Path) -> None:
    """`quantization="gguf"`: int8 with the file's scale per 32 inputs, split by shard."""
    from test_gguf import write_gguf  # tests/ is on the path (its conftest)

    from jaxinfer.weights import hf

    config, params = hf.load_hf_folder(TINY / "llama")
    write_gguf(tmp_path / "q8.gguf", config, params, "llama", quantize=("attn_", "ffn_"))
    model = load_model(tmp_path / "q8.gguf", quantization="gguf")
    assert model.params["layers"]["down_proj"].group_size == 32
    assert generate(model, tensor_parallel_size=2) == generate(model)


@pytest.mark.parametrize("impl", ["pallas-interpret", "pallas-tpu-interpret"])
def test_kernels_run_per_head_shard(llama, llama_single, impl: str) -> None:
    assert generate(llama, tensor_parallel_size=2, attention_impl=impl) == llama_single


def test_sampling_settings_and_logprobs_split(llama) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=3,
                            presence_penalty=0.5, logprobs=5)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(loaded=llama, max_model_len=64, max_num_seqs=4, block_size=4,
                  tensor_parallel_size=tp)
        outputs[tp] = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=params)
    for one, split in zip(outputs[1], outputs[2], strict=True):
        assert split.token_ids == one.token_ids
        for a, b in zip(one.logprobs, split.logprobs, strict=True):
            assert list(a) == list(b)  # the same top-5 ids, in order
            np.testing.assert_allclose(list(b.values()), list(a.values()), atol=1e-4)


def test_each_device_holds_its_share(llama) -> None:
    llm = LLM(loaded=llama, max_model_len=64, max_num_seqs=4, block_size=4,
              tensor_parallel_size=2)
    runner = llm.runner
    layers = runner.params["layers"]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        shard = layers[name].addressable_shards[0].data
        assert shard.nbytes * 2 == layers[name].nbytes, name
    assert runner.params["embed"].addressable_shards[0].data.shape == (128, 64)  # V / 2 rows
    for pool in (runner.kv.k, runner.kv.v):
        assert pool.addressable_shards[0].data.shape[2] == 1  # one of the 2 KV heads each
    assert runner.penalties.output_counts.addressable_shards[0].data.shape[1] == 128


def test_dummy_weights_are_made_split_and_equal_the_unsplit_ones() -> None:
    """Each device makes its own shard of random weights (a model too big for one
    device never exists whole), and the values do not depend on the split."""
    mesh = make_mesh(4)
    split = load_model("llama-3.2-1b", load_format="dummy", dtype="bfloat16", mesh=mesh)
    whole = load_model(TINY / "llama", load_format="dummy")
    for path, leaf in jax.tree_util.tree_flatten_with_path(split.params)[0]:
        name = jax.tree_util.keystr(path)
        assert leaf.sharding.mesh == mesh, name
    gate = split.params["layers"]["gate_proj"]  # [16, 8192, 2048]: 1/4 of the rows each
    assert gate.addressable_shards[0].data.shape == (16, 2048, 2048)
    assert gate.dtype == np.dtype("bfloat16")
    tiny_split = load_model(TINY / "llama", load_format="dummy", mesh=mesh)
    for a, b in zip(jax.tree.leaves(tiny_split.params), jax.tree.leaves(whole.params),
                    strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    values = np.asarray(whole.params["layers"]["q_proj"])
    assert abs(values.std() - 0.02) < 0.002 and np.unique(values).size > values.size // 2


def compiled_step_text(llm: LLM, num_tokens: int) -> str:
    """The optimized HLO of the step the runner compiles for `num_tokens` prompt tokens."""
    llm.generate(prompt_token_ids=[list(range(1, num_tokens + 1))],
                 sampling_params=SamplingParams(max_tokens=1, temperature=0))
    step = llm.runner._step
    runner = llm.runner
    batch, _ = runner._batch([], runner.step_shape([num_tokens], num_tokens))
    from jaxinfer.sampling import make_sampling_arrays

    sampling = make_sampling_arrays([], [], [], 1)
    lowered = step.lower(runner.params, runner.kv, runner.penalties, batch, sampling,
                         num_top_logprobs=5, prompt_logprobs=False)
    return lowered.compile().as_text()


def collectives(hlo: str) -> list[tuple[str, int, str]]:
    """(kind, elements, op name) of every collective in an HLO module's text."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= (\w+)\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|"
                          r"reduce-scatter|collective-permute)\(", line)
        if match:
            name = re.search(r'op_name="([^"]*)"', line)
            dims = [int(d) for d in match.group(2).split(",") if d]
            found.append((match.group(3), int(np.prod(dims)), name.group(1) if name else ""))
    return found


def test_step_has_megatron_collectives_and_no_vocabulary_gather(llama) -> None:
    """Per layer (the scan body, once in the HLO): one all-reduce after o_proj, one
    after down_proj. Top-5 log-probs come from per-shard top-k: the only gather holds
    shards x 5 values, never the vocabulary."""
    llm = LLM(loaded=llama, max_model_len=64, max_num_seqs=4, block_size=4,
              tensor_parallel_size=2)
    found = collectives(compiled_step_text(llm, 12))
    in_layers = [c for c in found if "while/body" in c[2] and "dot_general" in c[2]]
    assert [kind for kind, _, _ in in_layers] == ["all-reduce", "all-reduce"], found
    gathers = [c for c in found if c[0] == "all-gather"]
    assert gathers and all(elements < llama.config.vocab_size for _, elements, _ in gathers)
    assert not [c for c in found if c[0] in ("all-to-all", "collective-permute")], found


def test_more_shards_than_devices_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="xla_force_host_platform_device_count=16"):
        make_mesh(16)


def test_heads_must_split(llama) -> None:
    with pytest.raises(ConfigError, match="must divide the model's 4 attention heads"):
        LLM(loaded=llama, max_model_len=64, tensor_parallel_size=8)


@pytest.mark.parametrize("tp", [2, 4])
def test_real_gemma3_split_matches_hf(gemma, reference: dict, tp: int) -> None:
    cases = [c for c in reference["cases"].values() if len(c["prompt_ids"]) <= 32]
    llm = LLM(loaded=gemma, max_model_len=128, max_num_seqs=8, tensor_parallel_size=tp)
    params = SamplingParams(max_tokens=reference["new_tokens"], temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=[c["prompt_ids"] for c in cases],
                           sampling_params=params)
    for case, output in zip(cases, outputs, strict=True):
        assert output.token_ids == case["greedy_ids"], (tp, case["prompt"][:40])
    assert jax.device_count() == 8
