"""Text to token ids and back, and token ids to streamed text.

Every model jaxinfer serves comes with one of two kinds of tokenizer
(``backends``):

* **sentencepiece** (Gemma, Llama 2, Mistral). The ``ModelProto`` is read from a
  ``tokenizer.model`` or rebuilt in memory from a GGUF's ``tokenizer.ggml.*``
  metadata. Encoding runs in sentencepiece's C++ BPE; decoding is done here and
  follows Hugging Face's decoder chain (``▁`` becomes a space, byte pieces are
  fused into UTF-8), so ids and text agree with ``transformers`` token for token.
* **tokenizers** (Llama 3, Qwen2, SmolLM byte-level BPE), through the ``tokenizers``
  package: a ``tokenizer.json``, or built in memory from a GGUF whose
  ``tokenizer.ggml.model`` is ``gpt2`` (``gguf_bpe``: its merges, and the split
  regex its ``tokenizer.ggml.pre`` names, as llama.cpp reads them).

Special and added tokens (``<start_of_turn>``, ``<|im_end|>``, ``\\n``) are found
whole in the text before the model sees it, leftmost-longest, as HF does.

A :class:`Tokenizer` is built from where the model came from: a GGUF's metadata
(``gguf_vocab``), a Hugging Face folder (``hf_folder``), or the folder a converted
checkpoint saved it to (``core``: ``Tokenizer.save`` / ``Tokenizer.load``). Each
builder reads the same parts (``common.TokenizerParts``): a backend, the special
ids, whether to prepend BOS, the stop tokens and the chat template.

``chat`` turns a conversation into a prompt with the model's Jinja template, or
with the built-in template of its family when it ships none.

:class:`IncrementalDetokenizer` (``detokenizer``) turns the decode loop's
one-token-at-a-time output into text deltas. Like vLLM it re-decodes only a
short window of recent tokens (a prefix offset and a read offset), and it holds
back the bytes of a character that is not complete yet, so a stream never shows
half an emoji.

It imports nothing above it (engine, runner, llm, serve).
"""

from jaxinfer.tokenizer.core import META_FILE, Tokenizer
from jaxinfer.tokenizer.detokenizer import IncrementalDetokenizer

__all__ = ["META_FILE", "IncrementalDetokenizer", "Tokenizer"]
