"""The block manager: free list, reference counts, prefix cache (pure Python, no compilation)."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from jaxinfer.engine.block_manager import BlockManager, OutOfBlocksError

BS = 4  # block size for the prefix-cache tests


def _plain(num_blocks: int, block_size: int) -> BlockManager:
    """The plain allocator: a free list and reference counts, no prefix cache."""
    return BlockManager(num_blocks, block_size, enable_prefix_caching=False)


def _refs(manager: BlockManager, blocks) -> list[int]:
    """Reference counts of `blocks`, read from the manager's books."""
    return [manager._refs[b] for b in blocks]


def _run(manager: BlockManager, tokens: list[int]) -> list[int]:
    """Admit `tokens` as a prompt, compute it all and commit: the table it ends with."""
    table, _ = manager.match_prefix(tokens)
    assert manager.grow(table, len(tokens))
    manager.commit(table, tokens, len(tokens))
    return table


# -- the plain allocator --------------------------------------------------


def test_allocate_and_free_return_blocks_to_the_pool() -> None:
    pool = _plain(8, 16)
    first = pool.allocate(3)
    second = pool.allocate(5)
    assert len(set(first) | set(second)) == 8 and pool.num_free == 0
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.free(first)
    assert pool.num_free == 3 and pool.can_allocate(3) and not pool.can_allocate(4)
    assert sorted(pool.allocate(3)) == sorted(first)


def test_freeing_an_unallocated_block_is_an_error() -> None:
    pool = _plain(4, 4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([2])


@pytest.mark.parametrize(("tokens", "blocks"), [(1, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_rounds_up(tokens: int, blocks: int) -> None:
    assert _plain(4, 16).blocks_for(tokens) == blocks


def test_single_frees_set_the_allocation_order() -> None:
    pool = _plain(5, 4)
    order = [3, 0, 4, 1, 2]
    pool.allocate(5)
    for block in order:
        pool.free([block])
    assert pool.allocate(5) == order


# -- prefix caching -------------------------------------------------------


def test_shared_prefix_hits_and_partial_blocks_never_match() -> None:
    manager = BlockManager(num_blocks=16, block_size=BS)
    first = _run(manager, list(range(10)))  # blocks [0..3] [4..7], partial [8, 9]
    assert manager.num_cached == 2
    blocks, cached = manager.match_prefix([*range(10), 99])
    assert blocks == first[:2] and cached == 8  # the partial third block is not matched
    assert manager.match_prefix([0, 1, 2, 3, 4, 5, 6, 99, 8]) == ([first[0]], 4)
    assert manager.match_prefix([7, 1, 2, 3, 4]) == ([], 0)


def test_a_fully_cached_prompt_leaves_its_last_block_to_compute() -> None:
    manager = BlockManager(num_blocks=16, block_size=BS)
    table = _run(manager, list(range(12)))
    assert manager.match_prefix(list(range(12))) == (table[:2], 8)
    assert manager.match_prefix(list(range(13))) == (table, 12)
    assert manager.match_prefix([0]) == ([], 0)
    assert manager.match_prefix([]) == ([], 0)


def test_equal_blocks_after_different_prefixes_do_not_match() -> None:
    manager = BlockManager(num_blocks=16, block_size=BS)
    _run(manager, [1, 1, 1, 1, 2, 2, 2, 2, 0])
    blocks, cached = manager.match_prefix([3, 3, 3, 3, 2, 2, 2, 2, 0])
    assert (blocks, cached) == ([], 0)
    assert manager.match_prefix([2, 2, 2, 2, 0]) == ([], 0)  # block 2 alone is not a prefix


def test_keys_are_a_stable_blake2b_chain() -> None:
    """Keys must not depend on Python's per-process hash salt."""
    manager = BlockManager(8, BS)
    table = _run(manager, list(range(9)))
    first = hashlib.blake2b(struct.pack("<4q", 0, 1, 2, 3), digest_size=16).digest()
    second = hashlib.blake2b(first + struct.pack("<4q", 4, 5, 6, 7), digest_size=16).digest()
    assert [manager._key_of_block[b] for b in table[:2]] == [first, second]
    assert second.hex() == "ceb7796f6f9059e045e6ec8c7df2e484"


def test_freeing_one_sharer_keeps_the_prefix_for_the_other() -> None:
    manager = BlockManager(num_blocks=8, block_size=BS)
    first = _run(manager, list(range(9)))
    second = _run(manager, [*range(8), 50, 51])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert _refs(manager, first[:2]) == [2, 2]
    manager.free(first[::-1])
    assert _refs(manager, second) == [1, 1, 1]
    assert manager.num_used == 3 and manager.num_free == 5
    manager.free(second[::-1])
    assert manager.num_used == 0 and manager.num_free == 8 and manager.num_cached == 2


def test_cached_blocks_are_evicted_last_and_least_recently_used_first() -> None:
    manager = BlockManager(num_blocks=6, block_size=BS)
    old = _run(manager, [1] * 9)  # 3 blocks, 2 of them keyed
    new = _run(manager, [2] * 9)
    manager.free(old[::-1])  # tail first, as callers do
    manager.free(new[::-1])
    assert manager.num_free == 6 and manager.num_cached == 4
    # Truly free blocks (the two partial tails) go before any cached block.
    assert sorted(manager.allocate(2)) == sorted([old[2], new[2]])
    assert manager.num_cached == 4
    # Then the LRU order: `old` was freed first, tail first, so old[1] goes before old[0].
    assert manager.allocate(1) == [old[1]]
    assert manager.num_cached == 3
    assert manager.match_prefix([1] * 9) == ([old[0]], 4)  # evicted old[1] no longer matches
    manager.free([old[0]])  # refreshed: now the most recently used
    assert manager.allocate(2) == [new[1], new[0]]
    assert manager.match_prefix([2] * 9) == ([], 0)
    assert manager.allocate(1) == [old[0]] and manager.num_cached == 0
    with pytest.raises(OutOfBlocksError):
        manager.allocate(1)


def test_match_revives_an_unreferenced_cached_block() -> None:
    manager = BlockManager(num_blocks=4, block_size=BS)
    table = _run(manager, list(range(5)))
    manager.free(table[::-1])
    assert manager.num_free == 4 and manager.num_used == 0
    blocks, _ = manager.match_prefix(list(range(5)))
    assert blocks == table[:1] and _refs(manager, table[:1]) == [1]
    assert manager.num_free == 3 and manager.num_used == 1
    others = manager.allocate(3)  # must not hand out the revived block
    assert table[0] not in others and manager.num_cached == 1


def test_grow_extends_in_place_or_leaves_the_table_alone() -> None:
    manager = BlockManager(num_blocks=4, block_size=BS)
    table: list[int] = []
    assert manager.grow(table, 5) and len(table) == 2
    assert manager.grow(table, 8) and len(table) == 2  # already covered
    before = list(table)
    assert not manager.grow(table, 17)  # needs 3 more, only 2 free
    assert table == before and manager.num_free == 2
    assert manager.grow(table, 16) and len(table) == 4 and manager.num_free == 0


def test_commit_is_idempotent_and_waits_for_full_computed_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))
    table: list[int] = []
    manager.grow(table, len(tokens))
    manager.commit(table, tokens, 3)
    assert manager.num_cached == 0  # block 0 is not computed through yet
    manager.commit(table, tokens, 6)
    manager.commit(table, tokens, 6)
    assert manager.num_cached == 1
    manager.commit(table, tokens, 10)
    assert manager.num_cached == 2
    with pytest.raises(ValueError, match="num_computed"):
        manager.commit(table, tokens, 11)


def test_a_duplicate_block_keeps_the_first_holder() -> None:
    manager = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(5))
    a, b = manager.allocate(2), manager.allocate(2)  # computed twice, no sharing
    manager.commit(a, tokens, 5)
    manager.commit(b, tokens, 5)
    assert manager.num_cached == 1
    assert manager.match_prefix(tokens) == ([a[0]], 4)
    manager.free([a[0]])
    manager.free(b[::-1])  # b[0] duplicates a live key: plain free, not cached
    assert manager.num_cached == 1 and _refs(manager, a[:1]) == [1]


def test_hit_rate_counts_queried_and_hit_tokens() -> None:
    manager = BlockManager(num_blocks=16, block_size=BS)
    assert manager.hit_rate == 0.0
    _run(manager, list(range(10)))  # 10 queried, 0 hit
    manager.match_prefix(list(range(9)))  # 9 queried, 8 hit
    manager.match_prefix([7] * 5)  # 5 queried, 0 hit
    assert (manager.queried_tokens, manager.hit_tokens) == (24, 8)
    assert manager.hit_rate == pytest.approx(8 / 24)


def test_disabled_prefix_caching_is_the_plain_allocator() -> None:
    manager = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    table = _run(manager, list(range(9)))
    assert manager.num_cached == 0 and manager.match_prefix(list(range(9))) == ([], 0)
    assert manager.queried_tokens == 0 and manager.hit_rate == 0.0
    manager.free(table[::-1])
    assert manager.num_free == 4 and manager.num_cached == 0
    assert manager.allocate(4) == [3, *reversed(table)]  # FIFO free list, in freeing order


# -- randomized invariants ------------------------------------------------


def _assert_invariants(manager: BlockManager, tables: list[list[int]]) -> None:
    refs = [0] * manager.num_blocks
    for table in tables:
        for block in table:
            refs[block] += 1
    idle = list(manager._free) + list(manager._evictable)
    assert len(idle) == len(set(idle)) == manager.num_free
    assert all(refs[b] == 0 for b in idle)  # no block both free and referenced
    assert _refs(manager, range(manager.num_blocks)) == refs
    assert manager.num_used == sum(r > 0 for r in refs)
    assert manager.num_free + manager.num_used == manager.num_blocks
    assert all(manager._key_of_block[b] in manager._block_of_key for b in manager._evictable)


def _check_hit(manager: BlockManager, content: dict[int, tuple[int, ...]],
               prompt: list[int], blocks: list[int]) -> None:
    """Matched blocks must hold the KV of exactly this prompt's prefix."""
    for i, block in enumerate(blocks):
        assert content[block] == tuple(prompt[:(i + 1) * manager.block_size])


def test_random_operations_keep_the_books_straight() -> None:
    rng = random.Random(0)
    manager = BlockManager(num_blocks=24, block_size=BS)
    seqs: list[list[int]] = []  # token ids per live sequence
    tables: list[list[int]] = []
    content: dict[int, tuple[int, ...]] = {}  # block -> prefix whose KV it holds
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(5)]
    for _ in range(4000):
        op = rng.random()
        if op < 0.3:  # admit a prompt: a common prefix plus a random tail
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(4))]
            table, cached = manager.match_prefix(prompt)
            _check_hit(manager, content, prompt, table)
            if manager.grow(table, len(prompt)):
                seqs.append(prompt)
                tables.append(table)
                _compute(manager, content, prompt, table, cached)
            else:
                manager.free(table[::-1])
        elif op < 0.65 and seqs:  # decode one token
            i = rng.randrange(len(seqs))
            seqs[i].append(rng.randrange(3))
            if manager.grow(tables[i], len(seqs[i])):
                _compute(manager, content, seqs[i], tables[i], len(seqs[i]) - 1)
            else:  # preempt
                manager.free(tables.pop(i)[::-1])
                seqs.pop(i)
        elif seqs:  # finish
            i = rng.randrange(len(seqs))
            manager.free(tables.pop(i)[::-1])
            seqs.pop(i)
        _assert_invariants(manager, tables)
    assert manager.hit_tokens > 0


def _compute(manager: BlockManager, content: dict[int, tuple[int, ...]],
             tokens: list[int], table: list[int], start: int) -> None:
    """Pretend to write KV for tokens[start:] into `table`, then commit."""
    for i in range(start // BS, manager.blocks_for(len(tokens))):
        content[table[i]] = tuple(tokens[:(i + 1) * BS])
    manager.commit(table, tokens, len(tokens))
