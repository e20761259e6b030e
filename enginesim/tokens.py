"""A deterministic, cheap tokenizer and text generator.

Text is cut into pieces of up to four characters (about what BPE tokenizers average on
English), so equal prefixes give equal token sequences and prompt lengths are stable.
Generated text is drawn from a fixed vocabulary by a seeded hash, so the same request with
the same seed always gets the same answer.
"""

from __future__ import annotations

import hashlib
import zlib

PIECE = 4
VOCAB = (
    "the model serves tokens from a replica in the region closest to you while the control "
    "plane watches latency cost and health of every engine and routes each request to the "
    "best healthy place it may go under the rules of its tenant"
).split()


def tokenize(text: str) -> list[int]:
    return [zlib.crc32(text[i:i + PIECE].encode()) for i in range(0, len(text), PIECE)]


def count_tokens(text: str) -> int:
    return (len(text) + PIECE - 1) // PIECE


def generation_seed(prompt: str, seed: int | None, base_seed: int) -> int:
    digest = hashlib.blake2b(f"{base_seed}:{seed}:{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def token_text(seed: int, index: int) -> str:
    word = VOCAB[(seed >> (index % 40) ^ index * 2654435761) % len(VOCAB)]
    return word if index == 0 else " " + word


def natural_length(seed: int, low: int = 24, high: int = 200) -> int:
    """How long an answer runs when the client sets no max_tokens."""
    return low + seed % (high - low)
