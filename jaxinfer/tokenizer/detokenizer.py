"""Streaming: generated token ids, one at a time, to text deltas.

Like vLLM, :class:`IncrementalDetokenizer` re-decodes only a short window of
recent tokens (a prefix offset and a read offset), and it holds back the bytes
of a character that is not complete yet, so a stream never shows half an emoji.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.tokenizer.core import Tokenizer

# Prompt tokens kept as decode context by the detokenizer (vLLM uses the same 5).
_CONTEXT_TOKENS = 5


def _incomplete_utf8_tail(data: bytes) -> bool:
    """Whether ``data`` ends inside a UTF-8 character that more bytes could still complete."""
    for k in range(1, min(3, len(data)) + 1):
        lead = data[-k]
        if lead < 0x80:
            return False
        if lead >= 0xC0:
            try:
                data[-k:].decode("utf-8")
            except UnicodeDecodeError as err:
                return err.reason == "unexpected end of data" and err.start == 0
            return False
    return False


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas.

    Each :meth:`push` decodes only the tokens since the last emitted chunk (plus
    the chunk before it, as context for decoders that strip or merge across
    tokens), so a step costs O(1) in the length of the output. A character whose
    bytes are still arriving is held back until it completes; bytes that can never
    complete come out as U+FFFD, exactly as :meth:`Tokenizer.decode` shows them.
    The deltas concatenate to ``decode(generated_ids)``, with :meth:`flush`
    releasing a trailing incomplete character when the sequence ends.

    ``prompt_ids`` give the first tokens their context: the text is then what the
    generated ids add after the prompt (the same as decoding them alone for
    Gemma and byte-level BPE; a sentencepiece model with a dummy prefix keeps the
    leading space of the first word).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # the window: emitted tokens kept as context, then tokens not emitted yet
        self._ids = [int(i) for i in (prompt_ids or [])][-_CONTEXT_TOKENS:]
        self._read = len(self._ids)  # window tokens before this have been emitted
        self._chunks: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text (possibly empty)."""
        self._ids.append(int(token_id))
        window = self._decode(self._ids)
        if window.endswith("\ufffd") and self._tail_incomplete():
            return ""
        return self._emit(window)

    def flush(self) -> str:
        """Release whatever is held back (call once, when the sequence ends)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _emit(self, window: str) -> str:
        delta = window[len(self._decode(self._ids[: self._read])) :]
        # the tokens just emitted become the next window's context
        del self._ids[: self._read]
        self._read = len(self._ids)
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _tail_incomplete(self) -> bool:
        tail = b""
        for token_id in reversed(self._ids[self._read :]):
            tail = self._tok.token_bytes(token_id, self._skip) + tail
            if len(tail) >= 4:
                break
        return _incomplete_utf8_tail(tail)
