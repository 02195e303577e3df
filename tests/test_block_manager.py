"""The block allocator: free list and reference counts (pure Python, no compilation)."""

from __future__ import annotations

import pytest

from jaxinfer.engine.block_manager import BlockAllocator, OutOfBlocksError


def test_allocate_and_free_return_blocks_to_the_pool() -> None:
    pool = BlockAllocator(num_blocks=8, block_size=16)
    first = pool.allocate(3)
    second = pool.allocate(5)
    assert len(set(first) | set(second)) == 8 and pool.num_free == 0
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.free(first)
    assert pool.num_free == 3 and pool.can_allocate(3) and not pool.can_allocate(4)
    assert sorted(pool.allocate(3)) == sorted(first)


def test_shared_blocks_free_on_the_last_reference() -> None:
    pool = BlockAllocator(num_blocks=4, block_size=4)
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free == 2
    pool.free(blocks)
    assert pool.num_free == 4


def test_freeing_an_unallocated_block_is_an_error() -> None:
    pool = BlockAllocator(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([2])


@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_rounds_up(tokens: int, blocks: int) -> None:
    assert BlockAllocator(4, 16).blocks_for(tokens) == blocks
