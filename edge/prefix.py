"""Prefix affinity: block hashes of a prompt, an index of where prefixes were sent, and the
bounded-load consistent-hash home of a prefix.

Engines with prefix caching (vLLM's automatic prefix caching) keep the KV blocks of prompts
they have seen, in blocks of 16 tokens, each block's hash chained on the blocks before it.
The edge cannot tokenize cheaply, so it cuts the prompt's UTF-8 bytes into blocks of about
16 tokens (64 bytes) and chains a CRC over them: block i's key stands for the whole prefix up
to and including block i, as in the engine. Only full blocks count, as in the engine.

`PrefixIndex` remembers, per block key, which replicas were recently sent that prefix (an
LRU bounded in entries); the longest remembered prefix per replica estimates its cache hit.
A prefix nobody has seen yet goes to its home: the first replica in rendezvous-hash order
whose load is within a bound of the mean (consistent hashing with bounded loads), so every
edge sends a new prefix to the same replica, and a hot one spills over to the next instead of
piling onto one.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_BYTES = 64
MAX_BLOCKS = 512
# Keys carry the block depth in their high bits, so two prefixes collide only when their
# 32-bit CRCs agree at the same depth.
_DEPTH_SHIFT = 32


def block_keys(text: str | bytes, block_bytes: int = BLOCK_BYTES,
               max_blocks: int = MAX_BLOCKS, seed: int = 0) -> list[int]:
    """One key per full block of the prompt, each standing for the prefix up to that block.

    `seed` starts the chain: the tenant's (`tenant_seed`) where replicas keep each tenant's
    prefixes apart (`edge.cache_salt`), so the same prompt from two tenants has unrelated
    keys, as it has unrelated blocks in the engine; 0 where tenants share the cache."""
    data = text.encode() if isinstance(text, str) else text
    full = min(len(data) // block_bytes, max_blocks)
    keys = []
    crc = seed
    crc32 = zlib.crc32
    for depth in range(full):
        start = depth * block_bytes
        crc = crc32(data[start:start + block_bytes], crc)
        keys.append((depth << _DEPTH_SHIFT) | crc)
    return keys


def chat_prompt_text(messages: Sequence[object]) -> str | None:
    """The text of a chat request in order, roles included, as the engine's template sees it;
    None if some message is not an object with a string `role`."""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        if not isinstance(role, str):
            return None
        content = message.get("content")
        if isinstance(content, str):
            parts.append(f"{role}\x1f{content}\x1e")
        elif isinstance(content, list):
            parts.append(role + "\x1f")
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
            parts.append("\x1e")
        else:
            parts.append(role + "\x1f\x1e")
    return "".join(parts)


def tenant_seed(tenant: str) -> int:
    """The start of a tenant's prefix-key chains (never 0, the shared chains' start)."""
    return zlib.crc32(tenant.encode()) or 1


def conversation_key(messages: Sequence[object]) -> int | None:
    """A chat conversation's identity: the CRC of its messages up to and including the first
    user message (system prompt and opening question), which every later turn repeats and
    which differs between conversations that share a system prompt. None for messages that
    are not chat messages."""
    first = len(messages)
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            first = i + 1
            break
    text = chat_prompt_text(messages[:first])
    return None if text is None else zlib.crc32(text.encode())


class PrefixIndex:
    """Which replicas were recently sent which prefix blocks; LRU over block keys."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, keys: Sequence[int], replica_id: str) -> None:
        blocks = self._blocks
        # Deepest first, so that a prompt's earlier blocks are the more recently used and
        # eviction takes a prefix's tail before its head: holding block i then still means
        # holding every block before it, which `matched_blocks` relies on.
        for key in reversed(keys):
            holders = blocks.get(key)
            if holders is None:
                blocks[key] = {replica_id: None}
            else:
                holders[replica_id] = None
                blocks.move_to_end(key)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def holders(self, key: int) -> dict[str, None] | None:
        """The replicas remembered to hold the prefix that `key` stands for."""
        return self._blocks.get(key)

    def matched_blocks(self, keys: Sequence[int], replica_id: str) -> int:
        """How many leading blocks of `keys` this replica is remembered to hold.

        Eviction takes a prefix's later blocks first (see `record`), so holding block i means
        holding every block before it, and a binary search over depth is enough.
        """
        blocks = self._blocks
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            holders = blocks.get(keys[mid])
            if holders is not None and replica_id in holders:
                lo = mid + 1
            else:
                hi = mid
        return lo


def replica_id_hash(replica_id: str) -> int:
    return zlib.crc32(replica_id.encode())


def rendezvous_weight(key: int, id_hash: int) -> int:
    """A replica's rendezvous weight for a prefix key (from its `replica_id_hash`); the same
    in every process and on every edge."""
    # XOR alone would rank replicas by their hashes' spelling for most keys; a
    # multiply-xorshift round makes the order look random per key.
    value = ((id_hash ^ key) & 0xFFFFFFFF) * 0x2C1B3C6D & 0xFFFFFFFF
    value ^= value >> 15
    value = value * 0x297A2D39 & 0xFFFFFFFF
    return value ^ (value >> 15)


def load_bound(loads: Sequence[float], factor: float, floor: float) -> float:
    """The load under which a replica may attract a prefix: factor × mean (counting the
    request being placed), and at least `floor`, since continuous batching makes a few extra
    requests nearly free."""
    if not loads:
        return floor
    return max(floor, factor * (sum(loads) + 1) / len(loads))
