"""The KV block pool with prefix caching: chained hits, LRU eviction bounded by capacity,
and usage as vLLM reports it."""

from __future__ import annotations

import pytest

from enginesim.prefix_cache import BlockPool
from enginesim.tokenizer import block_hashes


def computed(pool: BlockPool, text: str) -> list[int]:
    """Allocate, compute and register `text`'s full blocks as a finished request would."""
    hashes = block_hashes(text)
    blocks = pool.allocate(len(hashes))
    pool.register(blocks, hashes, 0, len(hashes))
    return blocks


def test_a_freed_prompt_stays_findable_until_its_blocks_are_reused() -> None:
    pool = BlockPool(8)
    prompt = "a" * 64 * 3
    blocks = computed(pool, prompt)
    pool.release(blocks)
    assert pool.num_free == 8
    assert pool.lookup(block_hashes(prompt), 10) == blocks
    assert pool.usage() == 0.0  # cached but unreferenced blocks count as free


def test_lookup_stops_at_the_first_block_that_differs() -> None:
    pool = BlockPool(8)
    computed(pool, "a" * 64 + "b" * 64 + "c" * 64)
    hits = pool.lookup(block_hashes("a" * 64 + "X" * 64 + "c" * 64), 10)
    assert len(hits) == 1


def test_lookup_respects_the_maximum_it_is_given() -> None:
    pool = BlockPool(8)
    computed(pool, "a" * 64 * 4)
    assert len(pool.lookup(block_hashes("a" * 64 * 4), 2)) == 2


def test_allocation_evicts_the_least_recently_freed_blocks_first() -> None:
    pool = BlockPool(4)
    old = "o" * 64 * 2
    new = "n" * 64 * 2
    pool.release(computed(pool, old))
    pool.release(computed(pool, new))
    pool.allocate(2)
    assert pool.lookup(block_hashes(old), 2) == []
    assert len(pool.lookup(block_hashes(new), 2)) == 2


def test_the_end_of_a_prompt_is_evicted_before_its_shared_beginning() -> None:
    pool = BlockPool(3)
    prompt = "p" * 64 * 3
    pool.release(computed(pool, prompt))
    pool.allocate(1)
    assert len(pool.lookup(block_hashes(prompt), 3)) == 2


def test_taking_a_hit_keeps_its_blocks_from_eviction() -> None:
    pool = BlockPool(4)
    prompt = "s" * 64 * 2
    pool.release(computed(pool, prompt))
    hits = pool.lookup(block_hashes(prompt), 2)
    assert pool.can_allocate(2, hits) and not pool.can_allocate(3, hits)
    pool.take(hits)
    assert pool.usage() == 0.5
    pool.allocate(2)
    assert pool.num_free == 0
    assert pool.lookup(block_hashes(prompt), 2) == hits


def test_a_block_already_cached_under_its_hash_is_not_registered_twice() -> None:
    pool = BlockPool(4)
    prompt = "d" * 64
    first = computed(pool, prompt)
    second = computed(pool, prompt)
    assert pool.num_cached == 1
    pool.release(first)
    pool.release(second)
    assert pool.lookup(block_hashes(prompt), 1) == first


def test_usage_counts_blocks_held_by_running_sequences() -> None:
    pool = BlockPool(10)
    held = pool.allocate(3)
    assert pool.usage() == pytest.approx(0.3)
    pool.release(held)
    assert pool.usage() == 0.0
