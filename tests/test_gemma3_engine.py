"""Batch invariance on the real Gemma 3 270M: 32 prompts together equal each alone."""

from __future__ import annotations

import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.weights import LoadedModel

SYSTEM = ("You are a careful assistant for a small museum. Answer in one short sentence, "
          "and never invent facts about the collection.\n")
TOPICS = ["the Roman coins", "the whale skeleton", "opening hours", "the tea house",
          "the oldest map", "school visits", "the glass collection", "parking"]


def prompts(reference: dict) -> list[str]:
    cases = [c["prompt"] for c in reference["cases"].values()]
    shared = [f"{SYSTEM}Visitor: Tell me about {t}.\nAssistant:" for t in TOPICS]
    shared += [f"{SYSTEM}Visitor: Is {t} suitable for children?\nAssistant:" for t in TOPICS]
    mixed = [f"{i} + {i * 7} =" for i in range(5)] + [
        "Translate to French: good morning", "Once upon a time", "import numpy as np\n",
        "Liste des fleuves de France :", "ありがとう means", "The sum of the angles",
    ]
    out = cases + shared + mixed
    assert len(out) == 33
    return out[:32]


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(gemma: LoadedModel, reference: dict) -> list[list[int]]:
    llm = LLM(loaded=gemma, max_model_len=1280, max_num_seqs=1, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts(reference)]


@pytest.mark.parametrize(
    "settings",
    [{"enable_prefix_caching": False},
     {"enable_prefix_caching": True, "max_num_batched_tokens": 512},  # admitted over steps
     {"kv_cache_memory": 36_864 * 1_400}],  # 87 blocks: fewer than the crowd needs
    ids=["crowd", "crowd-prefix-cache", "crowd-tiny-pool"],
)
def test_32_prompts_together_equal_each_alone(gemma, reference, alone, settings) -> None:
    llm = LLM(loaded=gemma, max_model_len=1280, max_num_seqs=32, **settings)
    together = [o.token_ids for o in llm.generate(prompts(reference), GREEDY)]
    assert together == alone
    stats = llm.engine.snapshot()
    if "kv_cache_memory" in settings:
        assert stats["preemptions"] > 0
    if settings.get("enable_prefix_caching"):
        assert stats["prefix_cache_hit_rate"] > 0
