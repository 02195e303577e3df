"""The flags the `jaxinfer` commands share, and what they build from them.

The engine's commands (`jaxinfer.cli`, `jaxinfer.bench.cli`) and the server's
(`serve.cli`) all import this module, and it imports none of them: arrows
point down. Every `choices=` comes from `jaxinfer.choices` and every engine
flag from an `EngineConfig` field. Importing this module loads no JAX, so
`--help` and a mistyped flag answer at once; the handlers load what they use.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jaxinfer import compilation_cache
from jaxinfer.choices import (
    ATTENTION_IMPLS,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
)
from jaxinfer.engine.config import EngineConfig, list_engine_presets, load_engine_preset
from jaxinfer.parallel.multihost import DEFAULT_WORKER_TIMEOUT, DistributedConfig

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxinfer.weights import LoadedModel

AddArguments = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    """A subcommand of `jaxinfer`: `add_arguments` adds its flags and sets `handler`,
    a function of the parsed arguments that returns the exit status."""

    name: str
    help: str
    add_arguments: AddArguments


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gemma3-270m",
                        help="preset name, GGUF file, HF folder or jaxinfer checkpoint")
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    parser.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="a Hugging Face folder or tokenizer.json to use instead of the "
                        "model's own (e.g. for a GGUF whose tokenizer cannot be built)")
    add_quantization_flags(parser)


def add_quantization_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                        help="weight format, converted at load (default: none = float); "
                        "w8a8 also quantizes activations in batched steps; gguf keeps a "
                        "GGUF's own quant blocks exactly")
    parser.add_argument("--quant-group-size", type=int, default=128,
                        help="int4 group size along the input dimension (default 128)")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field; unset flags keep the preset's (or the default) value."""
    group = parser.add_argument_group("engine")
    group.add_argument("--engine-preset", default=None,
                       help="configs/engine/<name>.toml: " + ", ".join(list_engine_presets()))
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--kv-cache-memory", type=int, default=None,
                       help="bytes for the KV pool (default: fits the batch on CPU, "
                       "--kv-cache-fraction of free memory on accelerators)")
    group.add_argument("--kv-cache-fraction", type=float, default=None,
                       help="share of free accelerator memory for the KV pool, in (0, 1] "
                       "(default 0.9; unused with --kv-cache-memory or on CPU)")
    group.add_argument("--attention-impl", default=None, choices=ATTENTION_IMPLS,
                       help="xla (reference, CPU default) or the Pallas kernels")
    group.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                       help="auto: the model dtype; int8: int8 K/V with one f32 scale per "
                       "token and head (about 4x the tokens of a float32 cache)")
    group.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="split the model over this many devices (heads, MLP, vocabulary)")
    group.add_argument("--data-parallel-size", type=int, default=None,
                       help="replicas of the (split) model, each serving its own sequences "
                       "with its own KV pool; max_num_seqs and budgets are per replica")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", default=None)
    group.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false", default=None)


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "multi-host", "one process per host, the same command on each; process 0 serves, "
        "the others follow its steps")
    group.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                       help="process 0's host and a free port for JAX's coordinator "
                       "(the step broadcast uses PORT + 1)")
    group.add_argument("--num-processes", type=int, default=None,
                       help="processes in the job (one per host)")
    group.add_argument("--process-id", type=int, default=None,
                       help="this process's index, 0 = the one that serves")
    group.add_argument("--distributed", action="store_true",
                       help="join a multi-host job whose settings JAX detects "
                       "(Cloud TPU slices, SLURM)")
    group.add_argument("--worker-timeout", type=float, default=DEFAULT_WORKER_TIMEOUT,
                       help="seconds without a heartbeat before process 0 counts a follower "
                       f"as lost and turns NOT_SERVING (default {DEFAULT_WORKER_TIMEOUT:g})")


def distributed_config_from_args(args: argparse.Namespace) -> DistributedConfig:
    return DistributedConfig(
        coordinator_address=args.coordinator_address, num_processes=args.num_processes,
        process_id=args.process_id, auto=args.distributed, worker_timeout=args.worker_timeout)


def add_compilation_cache_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                        help="persistent XLA compilation cache (default: "
                        f"${compilation_cache.ENV_VAR} or {compilation_cache.default_dir()}; "
                        f"'{compilation_cache.OFF}' turns it off)")


def enable_compilation_cache(args: argparse.Namespace) -> None:
    """The cache `--compilation-cache-dir` asks for; call before anything compiles."""
    compilation_cache.enable(args.compilation_cache_dir)


def load_from_args(args: argparse.Namespace, source: str | None = None,
                   quantization: str | None = None) -> LoadedModel:
    """load_model with the model flags (`source`/`quantization` override them)."""
    from jaxinfer.weights import load_model

    load_format = getattr(args, "load_format", "auto")
    return load_model(source or args.model, dtype=args.dtype, load_format=load_format,
                      quantization=quantization or args.quantization,
                      quant_group_size=args.quant_group_size,
                      mesh=_dummy_mesh(args) if load_format == "dummy" else None,
                      tokenizer=getattr(args, "tokenizer", None))


def _dummy_mesh(args: argparse.Namespace) -> Mesh | None:
    """The engine's mesh, for random weights made already split; None on one device."""
    from jaxinfer.parallel.mesh import split_mesh

    return split_mesh(getattr(args, "tensor_parallel_size", None) or 1,
                      getattr(args, "data_parallel_size", None) or 1)


def engine_config_from_args(args: argparse.Namespace, **defaults: object) -> EngineConfig:
    """EngineConfig from --engine-preset, then `defaults`, then explicit flags."""
    base = load_engine_preset(args.engine_preset) if args.engine_preset else EngineConfig()
    if not args.engine_preset:
        base = base.replace(**defaults)
    return base.replace(**{f.name: getattr(args, f.name)
                           for f in dataclasses.fields(EngineConfig)})
