"""jaxinfer: an LLM inference engine on JAX/XLA.

    from jaxinfer import LLM, SamplingParams
    llm = LLM("gemma3-270m")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=16))[0].text)
"""

from jaxinfer.errors import ConfigError, JaxinferError, ModelLoadError, RequestError
from jaxinfer.llm import LLM, CompletionOutput, RequestOutput
from jaxinfer.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "ConfigError",
    "JaxinferError",
    "ModelLoadError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]
