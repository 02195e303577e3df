"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

A thin layer over `LLMEngine`: it queues every prompt, steps the engine until
all of them finish (continuous batching: a finished sequence's slot is
refilled on the next step), and returns the outputs in input order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm_engine import LLMEngine
from jaxinfer.errors import ConfigError, RequestError
from jaxinfer.model.config import ModelConfig
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.parallel.mesh import split_mesh
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer import Tokenizer
from jaxinfer.weights import DEFAULT_MODEL, LoadedModel, load_model
from jaxinfer.weights.quantize import DEFAULT_GROUP_SIZE

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]

TokenCallback = Callable[[RequestOutput, CompletionOutput, str], None]
PROGRESS_MIN_PROMPTS = 16  # show a progress bar for offline jobs at least this big


class LLM:
    """Load a model once, then generate for any number of prompts."""

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        dtype: str = "float32",
        load_format: str = "auto",
        quantization: str = "none",
        quant_group_size: int = DEFAULT_GROUP_SIZE,
        tokenizer: str | Path | None = None,
        engine_config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        **engine_settings: object,
    ) -> None:
        """`quantization`: none | int8 | w8a8 | int4 | int4-awq (weights, converted at
        load; int4 in groups of `quant_group_size` inputs). `tokenizer`: a Hugging Face
        folder or tokenizer.json to use instead of the model's own.
        `engine_settings` are EngineConfig fields (max_model_len, max_num_seqs,
        max_num_batched_tokens, block_size, kv_cache_memory, kv_cache_fraction, kv_cache_dtype,
        enable_prefix_caching, enable_chunked_prefill, attention_impl,
        tensor_parallel_size, data_parallel_size), applied over
        `engine_config`."""
        if loaded is not None and tokenizer is not None:
            raise ConfigError("tokenizer= applies when loading: pass it to load_model, or set "
                              "loaded.tokenizer, when giving loaded=")
        try:
            config = (engine_config or EngineConfig()).replace(**engine_settings)
        except TypeError as exc:
            raise ConfigError(f"unknown engine setting: {exc}") from exc
        self.model = loaded or load_model(
            model, dtype=dtype, load_format=load_format, quantization=quantization,
            quant_group_size=quant_group_size, tokenizer=tokenizer,
            mesh=split_mesh(config.tensor_parallel_size, config.data_parallel_size)
            if load_format == "dummy" else None)
        self.engine = LLMEngine(self.model, config)
        self.runner = self.engine.runner
        self.blocks = self.engine.blocks

    @property
    def tokenizer(self) -> Tokenizer:
        if self.model.tokenizer is None:
            raise ConfigError("this model was loaded without a tokenizer; pass token ids")
        return self.model.tokenizer

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def kv_cache_info(self) -> dict[str, int | str]:
        """The KV pool's size and storage type (e.g. float32, int8), as reported at start-up;
        bytes are per device (`devices` of them hold the split pool)."""
        runner = self.engine.runner
        return {
            "dtype": str(runner.kv.k.dtype),
            "num_blocks": runner.num_blocks,
            "block_size": runner.cache.block_size,
            "max_cached_tokens": runner.num_blocks * runner.cache.block_size,
            "bytes_per_token": runner.bytes_per_token,
            "bytes": runner.kv_bytes,
            "devices": runner.num_devices,
        }

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        on_token: TokenCallback | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); outputs keep the input order.

        Every prompt is validated before any runs: one bad prompt raises
        RequestError and nothing is queued.
        """
        inputs = [(text, self._tokens(text, ids))
                  for text, ids in _inputs(prompts, prompt_token_ids)]
        params = _per_request(sampling_params, len(inputs))
        for (_, tokens), p in zip(inputs, params, strict=True):
            self.engine.check_request(tokens, p)
        ids = [self.engine.add_request(prompt=text, prompt_token_ids=tokens, params=p).request_id
               for (text, tokens), p in zip(inputs, params, strict=True)]
        try:
            self._run(ids, on_token, use_tqdm and len(ids) >= PROGRESS_MIN_PROMPTS)
        except BaseException:
            for request_id in ids:
                self.engine.abort(request_id)
            self.engine.step()  # applies the aborts: their blocks return to the pool
            raise
        finally:
            outputs = [self.engine.get_request(i) for i in ids]
            for request_id in ids:
                self.engine.release(request_id)
        return outputs

    def _tokens(self, text: str | None, ids: list[int] | None) -> list[int]:
        if ids is not None:
            return ids
        if not isinstance(text, str):
            raise RequestError(f"prompts must be strings, got {type(text).__name__}")
        return self.tokenizer.encode(text)

    def _run(self, ids: list[str], on_token: TokenCallback | None, progress: bool) -> None:
        bar = tqdm(total=len(ids), desc="generate", unit="req") if progress else None
        pending = set(ids)
        while pending:
            for delta in self.engine.step():
                if on_token is not None and delta.request_id in pending:
                    request = self.engine.get_request(delta.request_id)
                    on_token(request, request.outputs[delta.index], delta.text)
                if delta.request_finished and delta.request_id in pending:
                    pending.discard(delta.request_id)
                    if bar is not None:
                        bar.update()
        if bar is not None:
            bar.close()

    def chat(
        self, messages: Sequence[dict[str, str]], sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        """Apply the model's chat template to one conversation and generate the reply."""
        prompt = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        return self.generate(prompt, sampling_params)[0]


def _inputs(
    prompts: str | Sequence[str] | None, token_ids: Sequence[Sequence[int]] | None
) -> list[tuple[str | None, list[int] | None]]:
    if (prompts is None) == (token_ids is None):
        raise RequestError("pass exactly one of prompts or prompt_token_ids")
    if token_ids is not None:
        return [(None, [int(i) for i in ids]) for ids in token_ids]
    if isinstance(prompts, str):
        prompts = [prompts]
    return [(text, None) for text in prompts]


def _per_request(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ConfigError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
