"""The KV cache as a pool of 16-token blocks with prefix caching, as vLLM v1 keeps it.

Every running sequence holds the blocks its tokens occupy. A full prompt block is
registered under its chained hash (enginesim.tokenizer.block_hashes) once computed, so a
later prompt with the same prefix finds those blocks and skips their prefill. A block whose
last holder finishes goes to the back of the free queue but keeps its hash: it still serves
hits until it is reused. Allocation takes blocks from the front of the free queue, the least
recently used, and forgets their hashes: the cache is bounded by the KV capacity itself, and
cached blocks are evicted only when live sequences need the room. A sequence frees its
blocks last-first, so the ends of prompts are evicted before their shared beginnings.

Usage is what vLLM reports as vllm:kv_cache_usage_perc: the fraction of blocks not free,
where a cached but unreferenced block counts as free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order: the front is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`, at most `max_blocks` of them."""
        found: list[int] = []
        cached = self._cached
        for block_hash in hashes[:max_blocks]:
            block = cached.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, new_blocks: int, hit_blocks: Sequence[int] = ()) -> bool:
        """Whether `new_blocks` fresh blocks fit once the `hit_blocks` are taken as well.

        Hit blocks that nobody holds sit in the free queue, so taking them uses free room.
        """
        idle_hits = sum(1 for block in hit_blocks if self._refs[block] == 0)
        return new_blocks <= len(self._free) - idle_hits

    def take(self, hit_blocks: Sequence[int]) -> None:
        """Hold cached blocks found by lookup(); they leave the free queue if idle."""
        refs, free = self._refs, self._free
        for block in hit_blocks:
            if refs[block] == 0:
                del free[block]
            refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, evicting the least recently used cached ones."""
        if count > len(self._free):
            raise RuntimeError(f"KV cache exhausted: {count} blocks asked, {len(self._free)} free")
        blocks = []
        refs, hashes, free, cached = self._refs, self._hash, self._free, self._cached
        for _ in range(count):
            block, _ = free.popitem(last=False)
            old = hashes[block]
            if old is not None:
                if cached.get(old) == block:
                    del cached[old]
                hashes[block] = None
            refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        refs, free = self._refs, self._free
        for block in reversed(blocks):
            refs[block] -= 1
            if refs[block] == 0:
                free[block] = None

    def register(self, blocks: Sequence[int], hashes: Sequence[int], start: int,
                 end: int) -> None:
        """Make blocks[start:end], now fully computed, findable under hashes[start:end]."""
        cached, block_hash = self._cached, self._hash
        for i in range(start, end):
            h = hashes[i]
            block = blocks[i]
            if block_hash[block] is None and h not in cached:
                block_hash[block] = h
                cached[h] = block
