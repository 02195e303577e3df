"""The real Gemma 3 270M against HF transformers' stored outputs (token for token)."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.weights import LoadedModel


def test_preset_config_matches_gguf_metadata(gemma: LoadedModel) -> None:
    from jaxinfer.weights import load_preset

    preset = load_preset("gemma3-270m").config
    assert preset == gemma.config
    assert gemma.config.num_layers == 18 and gemma.config.layer_types.count("global") == 3


def test_tokenizer_encodes_prompts_like_hf(gemma: LoadedModel, reference: dict) -> None:
    for name, case in reference["cases"].items():
        assert gemma.tokenizer.encode(case["prompt"]) == case["prompt_ids"], name


@pytest.mark.parametrize("name", ["english", "numbers"])
def test_a_sequence_decodes_the_same_alone_as_in_a_batch(
    gemma_llm: LLM, reference: dict, name: str
) -> None:
    case = reference["cases"][name]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    alone = gemma_llm.generate(prompt_token_ids=[case["prompt_ids"]], sampling_params=params)
    assert alone[0].token_ids == case["greedy_ids"][:16]
