"""The real Gemma 3 270M against HF transformers' stored outputs (token for token)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.model.transformer import full_logits
from jaxinfer.weights import LoadedModel


def test_preset_config_matches_gguf_metadata(gemma: LoadedModel) -> None:
    from jaxinfer.weights import load_preset

    preset = load_preset("gemma3-270m").config
    assert preset == gemma.config
    assert gemma.config.num_layers == 18 and gemma.config.layer_types.count("global") == 3


def test_tokenizer_encodes_prompts_like_hf(gemma: LoadedModel, reference: dict) -> None:
    for name, case in reference["cases"].items():
        assert gemma.tokenizer.encode(case["prompt"]) == case["prompt_ids"], name


def test_last_position_logits_match_hf(gemma: LoadedModel, reference: dict) -> None:
    params = jax.tree.map(jnp.asarray, gemma.params)
    run = jax.jit(full_logits, static_argnums=1)
    cases = list(reference["cases"].values())
    for bucket in (32, 1024):  # right-padding leaves earlier positions untouched (causal)
        group = [c for c in cases if (len(c["prompt_ids"]) <= 32) == (bucket == 32)]
        tokens = np.zeros((len(group), bucket), np.int32)
        for row, case in enumerate(group):
            tokens[row, : len(case["prompt_ids"])] = case["prompt_ids"]
        logits = np.asarray(run(params, gemma.config, tokens))
        for row, case in enumerate(group):
            last = logits[row, len(case["prompt_ids"]) - 1, case["logit_indices"]]
            error = np.abs(last - np.array(case["logit_values"])).max() / case["logit_spread"]
            assert error < 1e-3, (case["prompt"][:30], error)


def test_greedy_generation_matches_hf_token_for_token(gemma_llm: LLM, reference: dict) -> None:
    cases = list(reference["cases"].values())
    params = SamplingParams(max_tokens=reference["new_tokens"], temperature=0.0, ignore_eos=True)
    outputs = gemma_llm.generate(prompt_token_ids=[c["prompt_ids"] for c in cases],
                                 sampling_params=params)
    for case, output in zip(cases, outputs, strict=True):
        assert output.token_ids == case["greedy_ids"], case["prompt"][:40]
        assert output.finish_reason == "length"
        assert output.text == case["greedy_text"]


@pytest.mark.parametrize("name", ["english", "numbers"])
def test_a_sequence_decodes_the_same_alone_as_in_a_batch(
    gemma_llm: LLM, reference: dict, name: str
) -> None:
    case = reference["cases"][name]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = gemma_llm.generate(prompt_token_ids=[case["prompt_ids"]], sampling_params=params)
    assert alone[0].token_ids == case["greedy_ids"][:16]
