"""What ModelInfo reports: the model, its context and its KV cache."""

from __future__ import annotations

from jaxinfer.engine.llm_engine import LLMEngine
from serve.proto.jaxinfer.v1 import inference_pb2 as pb


def model_info(engine: LLMEngine) -> pb.ModelInfoResponse:
    config = engine.model.config
    return pb.ModelInfoResponse(
        name=config.name, architecture=config.architecture,
        context_length=engine.max_model_len, max_position=config.max_position,
        vocab_size=config.vocab_size, quantization=engine.model.describe_quantization(),
        dtype=str(engine.runner.dtype), kv_block_size=engine.config.block_size,
        kv_num_blocks=engine.runner.num_blocks, max_num_seqs=engine.config.max_num_seqs,
        has_tokenizer=engine.tokenizer is not None, load_format=engine.model.kind,
    )
