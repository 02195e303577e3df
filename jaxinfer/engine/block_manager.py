"""KV block allocation, like an OS page allocator: a free list and reference counts.

The pool's blocks are numbered 0..num_blocks-1. A sequence owns a block table,
the list of physical blocks holding its logical blocks in order. Blocks are
reference counted so that later features (prefix caching, parallel samples)
can share them; a block returns to the free list when its count drops to 0.

Pure Python, no jax: it tests in milliseconds.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockAllocator:
    """Free list plus reference counts over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (reference count 1 each)."""
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add a reference to each block (another sequence reads it too)."""
        for block in blocks:
            self._check_owned(block)
            self._refs[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference per block; blocks nobody references become free."""
        for block in blocks:
            self._check_owned(block)
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def _check_owned(self, block: int) -> None:
        if not 0 <= block < self.num_blocks or self._refs[block] == 0:
            raise ValueError(f"block {block} is not allocated")
