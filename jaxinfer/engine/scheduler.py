"""Iteration-level scheduling (Orca / vLLM style), pure Python: no jax import.

Every engine step asks `schedule()` which tokens to run next, within two
budgets: `max_num_seqs` running sequences and `max_num_batched_tokens` tokens.

1. Running sequences that are decoding get one token each, oldest first. A
   sequence whose next token needs a block that is not free preempts the
   newest running sequence (recompute: its blocks are freed and it returns to
   the front of the queue; when resumed it re-prefills prompt + output so far,
   and prefix caching usually makes that cheap).
2. Running sequences part-way through a chunked prefill get their next chunk.
3. Waiting sequences are admitted in FCFS order while a batch slot, the token
   budget and KV blocks allow. Their cached prefix (full blocks) is reused.
   With chunked prefill a long prompt takes what is left of the budget and
   continues next step, so decodes keep flowing beside it.

A sequence's `num_computed` counts the tokens whose K/V are in the cache; a
step over a chunk ending at the last known token samples a new token.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from .block_manager import BlockManager
from .config import SchedulerConfig


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SequenceState:
    """One sample of one request, as the scheduler sees it."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sample_index: int = 0
    wait_for: SequenceState | None = None  # a sibling whose prompt blocks this one will reuse
    use_prefix_cache: bool = True  # off when every prompt position must be computed
    seq_id: int = field(default_factory=itertools.count().__next__)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    slot: int = -1
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        prompt_len = len(self.prompt_ids)
        head = self.prompt_ids[start:stop]
        tail = self.output_ids[max(0, start - prompt_len): max(0, stop - prompt_len)]
        return head + tail

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def in_prefill(self) -> bool:
        """Tokens other than the newest sampled one still lack K/V (a fresh prompt's
        last token counts as prompt: it goes through a prefill chunk, not a decode)."""
        return self.num_computed < self.num_tokens - 1 or not self.output_ids


@dataclass
class PrefillChunk:
    seq: SequenceState
    start: int
    num_tokens: int
    first: bool = False  # the first chunk since (re)admission; start > 0 on a cache hit

    @property
    def completes(self) -> bool:
        """The chunk reaches the last known token, so the step samples a new one."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[SequenceState] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decodes)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Queues, admission, chunking, preemption. The engine applies the results."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._free_slots = list(range(config.max_num_seqs))[::-1]
        self.num_preemptions = 0

    def add(self, seq: SequenceState) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_decodes(out, budget)
        budget = self._schedule_running_prefills(out, budget)
        self._admit_waiting(out, budget)
        return out

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if seq.in_prefill or seq.status is not Status.RUNNING or budget < 1:
                continue
            if self._grow_or_preempt(seq, seq.num_tokens, out):
                out.decodes.append(seq)
                budget -= 1
        return budget

    def _grow_or_preempt(self, seq: SequenceState, num_tokens: int, out: SchedulerOutput) -> bool:
        """Cover num_tokens with blocks, preempting the newest others; False if seq itself went."""
        while not self.blocks.grow(seq.block_table, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: SequenceState, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        if seq in out.decodes:
            out.decodes.remove(seq)
        out.prefills = [c for c in out.prefills if c.seq is not seq]
        self._release(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _schedule_running_prefills(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.running):
            if not seq.in_prefill or budget < 1 or seq.status is not Status.RUNNING:
                continue
            chunk = self._chunk_size(seq, budget)
            if chunk and self._grow_or_preempt(seq, seq.num_computed + chunk, out):
                out.prefills.append(PrefillChunk(seq, seq.num_computed, chunk))
                budget -= chunk
        return budget

    def _chunk_size(self, seq: SequenceState, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and self._free_slots and budget > 0:
            seq = self.waiting[0]
            if seq.wait_for is not None and seq.wait_for.status is not Status.FINISHED and (
                seq.wait_for.status is Status.WAITING or seq.wait_for.in_prefill
            ):
                return  # FCFS: the sibling's prompt blocks come first
            if not self._admit(seq, out, budget):
                return
            budget -= out.prefills[-1].num_tokens

    def _admit(self, seq: SequenceState, out: SchedulerOutput, budget: int) -> bool:
        matched, cached = self.blocks.match_prefix(seq.all_ids) if seq.use_prefix_cache else (
            [], 0)
        seq.block_table, seq.num_computed = list(matched), cached
        chunk = self._chunk_size(seq, budget)
        if not chunk or not self.blocks.grow(seq.block_table, cached + chunk):
            self.blocks.free(seq.block_table[::-1])
            seq.block_table, seq.num_computed = [], 0
            return False
        self.waiting.popleft()
        if not seq.output_ids:  # a resumed sequence keeps its first admission's figure
            seq.num_cached = cached
        seq.status, seq.slot = Status.RUNNING, self._free_slots.pop()
        self.running.append(seq)
        out.prefills.append(PrefillChunk(seq, cached, chunk, first=True))
        return True

    def on_computed(self, seq: SequenceState, num_tokens: int) -> None:
        """The device wrote K/V for num_tokens more tokens of seq."""
        seq.num_computed += num_tokens
        self.blocks.commit(seq.block_table, seq.all_ids, seq.num_computed)

    def finish(self, seq: SequenceState) -> None:
        """Retire a sequence (finished or aborted) and free what it holds."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def _release(self, seq: SequenceState) -> None:
        self.blocks.free(seq.block_table[::-1])  # tail first: the prefix is evicted last
        seq.block_table = []
        self._free_slots.append(seq.slot)
        seq.slot = -1
