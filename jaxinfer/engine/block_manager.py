"""KV block management, like an OS page allocator, with automatic prefix caching.

The pool's blocks are numbered 0..num_blocks-1. A sequence owns a block table,
the list of physical blocks holding its logical blocks in order. Blocks are
reference counted so that sequences can share them (common prompt prefixes,
parallel samples).

Prefix caching (as in vLLM) keeps the KV of finished work around:

* `commit` gives every FULL, computed block of a table a key: a hash chain
  `key_i = blake2b(key_{i-1} || token ids of block i)`. The chain makes a key
  name the whole prefix, so equal blocks after different prefixes never match.
* `match_prefix` looks a new prompt's full blocks up by key and takes a
  reference on the longest matching run; the caller skips computing them.
* A block whose last reference goes is not wiped: if it holds a key it joins
  an LRU of evictable blocks and can still be matched (and revived). `allocate`
  takes truly free blocks first and evicts the least recently used cached
  block only when none remain.

Each block is in exactly one state:

    free       refs == 0, no key       in `_free`
    evictable  refs == 0, key          in `_evictable` (LRU, oldest first)
    in use     refs >= 1, key or not   in neither

Keys use blake2b over little-endian int64 token ids, not Python's salted
`hash()`, so they are the same in every process.

Pure Python, no jax: it tests in milliseconds.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

_ROOT_KEY = b""  # parent key of a sequence's first block
_KEY_BYTES = 16


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockManager:
    """Reference-counted blocks of `block_size` tokens, with an optional prefix cache.

    Callers keep one block table per sequence, in logical order, and:

    1. `blocks, cached = match_prefix(prompt)` then `grow(blocks, len(prompt))`
       (or `free(blocks)` if growing fails); compute tokens from `cached` on;
    2. `commit(blocks, tokens, num_computed)` after each step that computed KV;
    3. `free(blocks[::-1])` when done: pass the table TAIL FIRST. `free` releases
       blocks in the order given, so the prefix joins the LRU last and is
       evicted last (its blocks are the ones most likely to be matched again).

    Shared blocks are never written: `match_prefix` shares only full blocks.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._key_of_block: dict[int, bytes] = {}  # every committed block
        self._block_of_key: dict[bytes, int] = {}  # one registered holder per key
        self._packer = struct.Struct(f"<{block_size}q")
        self.queried_tokens = 0
        self.hit_tokens = 0

    # -- counters --------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks allocatable now: truly free plus cached but unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix key (referenced or evictable)."""
        return len(self._block_of_key)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens queried."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # -- allocation ------------------------------------------------------

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        """Take `count` exclusive blocks (refs 1): free ones first, then evict LRU cached ones."""
        if count > self.num_free:
            raise OutOfBlocksError(f"asked for {count} blocks, {self.num_free} free")
        blocks = [self._take_one() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extend `block_table` in place to cover `num_tokens`; False (unchanged) if short."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need <= 0:
            return True
        if not self.can_allocate(need):
            return False
        block_table.extend(self.allocate(need))
        return True

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block, in the order given: pass a table tail first.

        A block left unreferenced becomes evictable if it holds a registered key,
        else free; later releases are younger in the LRU, so `free(table[::-1])`
        makes the prefix blocks, the ones most likely to be matched, go last.
        """
        for block in blocks:
            self._check_owned(block)
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._release(block)

    # -- prefix cache ----------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Reference the longest cached run of full blocks of `token_ids`.

        Returns (blocks, num_cached_tokens). At least one token is always left
        to compute, so the caller gets logits: a prompt that is all full cached
        blocks matches all but its last block. Returns ([], 0) when disabled.
        """
        if not self.enable_prefix_caching:
            return [], 0
        usable = max(len(token_ids) - 1, 0) // self.block_size
        blocks = self._lookup(token_ids, usable)
        for block in blocks:
            self._acquire(block)
        num_cached = len(blocks) * self.block_size
        self.queried_tokens += len(token_ids)
        self.hit_tokens += num_cached
        return blocks, num_cached

    def commit(self, block_table: Sequence[int], token_ids: Sequence[int],
               num_computed: int) -> None:
        """Key every full, computed block of `block_table` so later prompts can reuse it.

        Block i is committed once (i + 1) * block_size <= num_computed. Idempotent
        and cheap to repeat: it hashes only blocks not keyed yet. A key already
        held by another block keeps that holder.
        """
        if not self.enable_prefix_caching:
            return
        if not 0 <= num_computed <= len(token_ids):
            raise ValueError(f"num_computed must be in [0, {len(token_ids)}], "
                             f"got {num_computed}")
        num_full = min(num_computed // self.block_size, len(block_table))
        start = self._first_unkeyed(block_table, num_full)
        parent = self._key_of_block[block_table[start - 1]] if start else _ROOT_KEY
        for i in range(start, num_full):
            block = block_table[i]
            self._check_owned(block)
            parent = self._key(parent, token_ids, i)
            self._key_of_block[block] = parent
            self._block_of_key.setdefault(parent, block)

    # -- internals -------------------------------------------------------

    def _key(self, parent: bytes, token_ids: Sequence[int], index: int) -> bytes:
        """Chain key of block `index`: hash of the parent key and its token ids."""
        lo = index * self.block_size
        digest = hashlib.blake2b(parent, digest_size=_KEY_BYTES)
        digest.update(self._packer.pack(*token_ids[lo:lo + self.block_size]))
        return digest.digest()

    def _lookup(self, token_ids: Sequence[int], max_blocks: int) -> list[int]:
        """Registered blocks for the longest chain of the first `max_blocks` blocks."""
        blocks: list[int] = []
        parent = _ROOT_KEY
        for i in range(max_blocks):
            parent = self._key(parent, token_ids, i)
            block = self._block_of_key.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _first_unkeyed(self, block_table: Sequence[int], num_full: int) -> int:
        """Index after the last keyed block among the first `num_full` (keys form a prefix)."""
        start = num_full
        while start and block_table[start - 1] not in self._key_of_block:
            start -= 1
        return start

    def _acquire(self, block: int) -> None:
        """Reference a cached block, reviving it from the evictable LRU if unreferenced."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        """Park an unreferenced block: evictable if it can be matched, else free."""
        key = self._key_of_block.get(block)
        if key is not None and self._block_of_key.setdefault(key, block) == block:
            self._evictable[block] = None
            return
        self._key_of_block.pop(block, None)  # an unregistered duplicate: drop its key
        self._free.append(block)

    def _take_one(self) -> int:
        """A truly free block if any, else the least recently used evictable one."""
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._block_of_key[self._key_of_block.pop(block)]
        return block

    def _check_owned(self, block: int) -> None:
        if not 0 <= block < self.num_blocks or self._refs[block] == 0:
            raise ValueError(f"block {block} is not allocated")


class BlockPools:
    """The block managers of every data-parallel rank (each its own KV pool, block
    ids from 0), with their counters summed."""

    def __init__(self, ranks: list[BlockManager]) -> None:
        self.ranks = ranks

    @property
    def num_blocks(self) -> int:
        return sum(r.num_blocks for r in self.ranks)

    @property
    def num_free(self) -> int:
        return sum(r.num_free for r in self.ranks)

    @property
    def num_used(self) -> int:
        return sum(r.num_used for r in self.ranks)

    @property
    def hit_tokens(self) -> int:
        return sum(r.hit_tokens for r in self.ranks)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the caches over prompt tokens queried, all ranks."""
        queried = sum(r.queried_tokens for r in self.ranks)
        return self.hit_tokens / queried if queried else 0.0
