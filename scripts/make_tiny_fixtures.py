"""Make the tiny Hugging Face fixtures under tests/data/tiny/ (run once; CI only reads them).

Each fixture is a randomly initialised HF model saved with `save_pretrained`
(f32 safetensors + config.json) plus `expected.npz` holding a fixed input
`tokens` [2, 12] and HF's eager-attention f32 `logits` [2, 12, V]. The tests
load the folder with `jaxinfer.weights.hf.load_hf_folder`, run our forward
pass and compare against those logits.

Needs the `reference` extras (torch, transformers), which CI does not install:

    python scripts/make_tiny_fixtures.py [--out tests/data/tiny] [--only qwen3 mistral]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

BATCH, SEQ = 2, 12
KEEP_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


def make_llama() -> PreTrainedModel:
    """Llama 3 style: GQA 4/2, head_dim 32 != hidden/heads, llama3 RoPE scaling, untied head."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=[2, 3],
        # original_max_position 32 puts the llama3 wavelength cut-offs (8 and 32
        # tokens) inside the spectrum of head_dim 32, so all three bands occur.
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    return LlamaForCausalLM(config)


def make_qwen2() -> PreTrainedModel:
    """Qwen2 style: q/k/v biases, GQA 4/2, tied embeddings."""
    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=5, eos_token_id=6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return Qwen2ForCausalLM(config)


def make_qwen3() -> PreTrainedModel:
    """Qwen3 style: per-head q/k RMSNorm, no biases, head_dim 32 != hidden/heads, tied."""
    config = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=5, eos_token_id=6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return Qwen3ForCausalLM(config)


def make_mistral() -> PreTrainedModel:
    """Mistral style: every layer a sliding-window layer (window 4 < the 12 tokens)."""
    config = MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=4, bos_token_id=1,
        eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    )
    return MistralForCausalLM(config)


def make_gemma3() -> PreTrainedModel:
    """Gemma 3 text: 6 layers mixing local/global, window 4, scalar 24 != head_dim 16."""
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=4, max_position_embeddings=128,
        layer_types=[
            "sliding_attention", "sliding_attention", "full_attention",
            "sliding_attention", "sliding_attention", "full_attention",
        ],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0,
    )
    return Gemma3ForCausalLM(config)


def randomize(model: PreTrainedModel, seed: int) -> None:
    """Make every weight random: HF zero-inits norms (Gemma) and biases, hiding mapping bugs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                # Gemma stores w with scale (1 + w); Llama stores the scale itself.
                base = 0.0 if isinstance(model, Gemma3ForCausalLM) else 1.0
                param.copy_(base + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.2 * noise)


def reference_logits(model: PreTrainedModel, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed tokens [B, T] and HF's f32 logits [B, T, V]."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.config.vocab_size, size=(BATCH, SEQ), dtype=np.int32)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)))
    return tokens, out.logits.float().numpy()


def save_fixture(
    name: str, make: Callable[[], PreTrainedModel], seed: int, out: Path, shard: str | None
) -> None:
    torch.manual_seed(seed)
    model = make()
    model.set_attn_implementation("eager")  # the exact reference, no fused kernels
    randomize(model, seed)
    model.eval()
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    for extra in folder.iterdir():
        if extra.name not in KEEP_FILES and not extra.name.startswith("model-"):
            extra.unlink()  # tokenizer-free fixtures: drop generation_config.json and the like
        else:
            extra.chmod(0o644)  # safetensors writes 0600
    tokens, logits = reference_logits(model, seed)
    np.savez(folder / "expected.npz", tokens=tokens, logits=logits)
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"{name}: {sorted(f.name for f in folder.iterdir())} {size / 1024:.0f} KiB")


# name -> (model maker, seed, safetensors shard size)
FIXTURES: dict[str, tuple[Callable[[], PreTrainedModel], int, str | None]] = {
    "llama": (make_llama, 0, "200KB"),
    "qwen2": (make_qwen2, 1, None),
    "gemma3": (make_gemma3, 2, None),
    "qwen3": (make_qwen3, 3, None),
    "mistral": (make_mistral, 4, None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/data/tiny"))
    parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), default=None,
                        help="make these fixtures only (default: all)")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float32)
    for name in args.only or FIXTURES:
        make, seed, shard = FIXTURES[name]
        save_fixture(name, make, seed, args.out, shard=shard)


if __name__ == "__main__":
    main()
