"""The serving core: the scheduler and block manager (pure Python, no jax), the
engine host loop over them, and its asyncio face.

Words, one meaning each (the code and its comments keep to them):

- **request**: what a client sent (a prompt and its sampling settings); it may ask
  for `n` samples. Outputs: `RequestOutput`, streamed as `StreamDelta` values.
- **sample**: one of a request's `n` completions (`CompletionOutput.index`).
- **sequence**: one sample's token stream (prompt + output) and its KV cache; the
  scheduler's record of it is a `SequenceState`.
- **block**: `block_size` tokens of K/V in the pool of every layer.
- **block table**: a sequence's blocks, in order (`SequenceState.block_table`).
- **KV row**: one token's place in a layer's pool, `block * block_size + offset`;
  a step's `kv_rows` say where each new token's K/V is written.
- **slot**: a running sequence's row in per-sequence device state (the penalty
  statistics); free slots are handed out at admission and returned at finish.
- **step**: one engine iteration: one scheduling decision and its one device call
  over a flat batch of every scheduled sequence's query tokens.
- **chunk**: the part of a prompt one step runs (chunked prefill: `PrefillChunk`).
- **rank**: a data-parallel replica of the model, with its own scheduler, blocks
  and slots; a sequence lives on one rank (`data_parallel_size` of them).
- **shard**: a tensor-parallel part of the model on one device of a rank
  (`tensor_parallel_size` of them).
- **query**: the tokens a sequence runs in a step (a chunk, or its last sampled
  token when decoding), as the runner receives them: `SequenceQuery`; its
  **query length** is their count.
"""
