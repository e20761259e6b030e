"""A prefix cache of 16-token blocks with chained hashes and LRU eviction, as vLLM keeps.

A block's hash covers its tokens and the hash of the block before it, so a block matches
only when the whole prefix up to it matches. Only full blocks are cached.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK = 16


def block_hashes(tokens: list[int]) -> list[int]:
    hashes = []
    parent = 0
    for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        parent = hash((parent, tuple(tokens[start:start + BLOCK])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(capacity_blocks, 0)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def cached_tokens(self, hashes: list[int]) -> int:
        """Tokens of the longest cached prefix; touches matched blocks (LRU)."""
        matched = 0
        for block in hashes:
            if block not in self.blocks:
                break
            self.blocks.move_to_end(block)
            matched += 1
        return matched * BLOCK

    def insert(self, hashes: list[int]) -> None:
        for block in hashes:
            if block in self.blocks:
                self.blocks.move_to_end(block)
            else:
                self.blocks[block] = None
        self.shrink(self.capacity)

    def shrink(self, capacity: int) -> None:
        while len(self.blocks) > max(capacity, 0):
            self.blocks.popitem(last=False)
