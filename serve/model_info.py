"""What ModelInfo reports: the model, its context and its KV cache."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf

from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_file import read_gguf
from jaxinfer.weights import LoadedModel, load_preset, resolve_source
from serve.proto.jaxinfer.v1 import inference_pb2 as pb

logger = logging.getLogger(__name__)


def model_info(engine: LLMEngine) -> pb.ModelInfoResponse:
    config = engine.model.config
    return pb.ModelInfoResponse(
        name=config.name, architecture=config.architecture,
        context_length=engine.max_model_len, max_position=config.max_position,
        vocab_size=config.vocab_size, quantization=quantization(engine.model),
        dtype=str(engine.runner.dtype), kv_block_size=engine.config.block_size,
        kv_num_blocks=engine.runner.num_blocks, max_num_seqs=engine.config.max_num_seqs,
        has_tokenizer=engine.tokenizer is not None, load_format=engine.model.kind,
    )


def quantization(model: LoadedModel) -> str:
    """The source weights' GGUF file type (e.g. "Q4_K_M"); "none" for other formats.

    The engine computes with dequantized weights of `dtype`; this names what
    the weights were stored as. LoadedModel does not record it, so a GGUF
    source is read again (metadata only).
    """
    if model.kind != "gguf":
        return "none"
    try:
        path = Path(model.source)
        if not path.is_file():
            path = resolve_source(load_preset(model.source).source or "")
        file_type = read_gguf(path, with_tensors=False).get("general.file_type")
        return "unknown" if file_type is None else gguf.LlamaFileType(file_type).name.removeprefix(
            "MOSTLY_")
    except (JaxinferError, OSError, ValueError) as exc:
        logger.warning("cannot read the GGUF file type of %s: %s", model.source, exc)
        return "unknown"
