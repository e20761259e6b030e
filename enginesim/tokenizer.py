"""The simulator's tokenizer, chat template and text generator: deterministic and cheap.

Tokenizer: a prompt is cut into pieces of four characters from its start (the last piece may
be shorter); each piece is one token. Four characters is about what BPE tokenizers average
on English, so counts land near a real model's, and they are exact and stable: the same text
always has the same count, and two texts that share a prefix share its tokens, which is what
prefix caching needs. No token ids are materialised: the prefix cache only needs the chained
hash of each full 16-token block, taken over the block's 64 characters.

Token ids, for /tokenize, /detokenize and the render endpoints, are made only when asked for:
a four-character ASCII piece is its characters as a base-128 number (below 2**28), a shorter
ASCII piece (a prompt's last) has a range of its own above that, and a piece with other
characters gets an id from a table this process keeps (above 2**29). Every id below 2**28
therefore decodes to exactly four characters, so a prompt given as token ids, even a real
tokenizer's, keeps its token count. Ids of ASCII text are the same in every process; an id
the process never gave out decodes to nothing, as a real tokenizer's unknown id does.

Chat template: each message becomes `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}
<|eot_id|>` after a `<|begin_of_text|>`, and the assistant header closes the prompt, as in
Llama 3's template; list contents keep their text parts.

Generator: output tokens are words drawn from a fixed corpus (a pseudo-random sequence over a
small vocabulary, the same in every process) starting at an offset derived from the server's
seed, the request's seed and the prompt, so the same request to a server started with the
same seed always gets the same text. A request that sets no limit ends where its own
"natural length" (also derived from that offset) puts an end-of-sequence token, whose text
is empty, as a model's EOS is after detokenisation.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any

PIECE_CHARS = 4
BLOCK_TOKENS = 16
BLOCK_CHARS = PIECE_CHARS * BLOCK_TOKENS

BEGIN = "<|begin_of_text|>"
HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"
END_OF_TURN = "<|eot_id|>"

_WORDS = (
    "the of and to in is that for it as with was on be by this are or from at which an "
    "not have has but can all more one were their will they its so also into other than "
    "may some these time only new about when two most over such out would up first after "
    "any use where between each many well through them could then system request model "
    "region replica edge latency token cache prefix engine route plane control cost "
    "cluster capacity queue batch stream health policy tenant quota offer price spot "
    "answer question data value result state table version signed every fast slow near "
    "far good simple clear small large high low short long open local global network "
    "memory compute serve place move scale drain keep send read write wait start stop"
).split()
_PUNCTUATION = (",", ".", ",", ".", ";", ":")
VOCABULARY: tuple[str, ...] = tuple(" " + w for w in _WORDS) + _PUNCTUATION
# Each entry as a JSON string literal, ready to drop into an SSE frame.
VOCABULARY_JSON: tuple[bytes, ...] = tuple(
    json.dumps(t, ensure_ascii=False).encode() for t in VOCABULARY)
CORPUS_LEN = 1 << 16
# Same in every process: a fixed seed, independent of the server's --seed.
CORPUS: tuple[int, ...] = tuple(random.Random(0x5EED).choices(
    range(len(VOCABULARY)), weights=[6] * len(_WORDS) + [4] * len(_PUNCTUATION),
    k=CORPUS_LEN))

MIN_NATURAL = 32
MAX_NATURAL = 512


def count_tokens(text: str) -> int:
    return -(-len(text) // PIECE_CHARS)


def block_hashes(text: str, block_tokens: int = BLOCK_TOKENS,
                 cache_salt: str | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks of `block_tokens` tokens (16 unless the
    profile says otherwise; the last partial block has none).

    Block i's hash covers its own characters and block i-1's hash, so it matches another
    prompt's block only when the whole prefix up to and including it is equal. A request's
    `cache_salt` is mixed into the first block's hash alone, as vLLM mixes it into that
    block's extra keys: every later block chains on it, so prompts with different salts
    share no block.
    """
    hashes: list[int] = []
    parent = 0
    chars = PIECE_CHARS * block_tokens
    for start in range(0, len(text) - chars + 1, chars):
        if start == 0 and cache_salt:
            parent = hash((parent, text[start:start + chars], cache_salt))
        else:
            parent = hash((parent, text[start:start + chars]))
        hashes.append(parent)
    return hashes


_FULL_IDS = 1 << 28          # ids of four-character ASCII pieces: 0 .. 2**28 - 1
_SHORT_IDS = 1 << 28         # 1-3 character ASCII pieces: _SHORT_IDS + (length-1) * 2**21 + value
_TABLE_IDS = 1 << 29         # pieces with non-ASCII characters: _TABLE_IDS + table index
_TABLE_CAP = 1 << 20         # beyond this many distinct such pieces, they share one id
_table: dict[str, int] = {}
_table_pieces: list[str] = []


def pieces(text: str) -> list[str]:
    """The text's tokens as text: four characters each, the last possibly shorter."""
    return [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]


def piece_id(piece: str) -> int:
    if piece.isascii():
        value = 0
        for char in piece:
            value = (value << 7) | ord(char)
        if len(piece) == PIECE_CHARS:
            return value
        return _SHORT_IDS + ((len(piece) - 1) << 21) + value
    known = _table.get(piece)
    if known is None:
        if len(_table_pieces) >= _TABLE_CAP:
            return _TABLE_IDS + _TABLE_CAP  # decodes to nothing
        known = _TABLE_IDS + len(_table_pieces)
        _table[piece] = known
        _table_pieces.append(piece)
    return known


def id_piece(token_id: int) -> str:
    """The text of one token id; an id never given out is empty."""
    if 0 <= token_id < _FULL_IDS:
        return "".join(chr((token_id >> shift) & 0x7F) for shift in (21, 14, 7, 0))
    if _SHORT_IDS <= token_id < _SHORT_IDS + (3 << 21):
        length = ((token_id - _SHORT_IDS) >> 21) + 1
        value = (token_id - _SHORT_IDS) & ((1 << 21) - 1)
        return "".join(chr((value >> (7 * k)) & 0x7F) for k in range(length - 1, -1, -1))
    index = token_id - _TABLE_IDS
    return _table_pieces[index] if 0 <= index < len(_table_pieces) else ""


def encode(text: str) -> list[int]:
    return [piece_id(p) for p in pieces(text)]


def decode(token_ids: Sequence[int]) -> str:
    return "".join(id_piece(t) for t in token_ids)


class ChatFormatError(ValueError):
    """The messages cannot be rendered; the message says which one and why, `loc` where
    (e.g. "messages.0.role", as a validation error's location reads)."""

    def __init__(self, message: str, loc: str = "messages") -> None:
        super().__init__(message)
        self.loc = loc


def render_chat(messages: Sequence[Any], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The prompt for `messages`. With `continue_final_message` the last message is left
    open (no end of turn), so that the model continues its text."""
    parts = [BEGIN]
    last = len(messages) - 1
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatFormatError(f"messages[{i}]: expected an object", f"messages.{i}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatFormatError(f"messages[{i}].role: expected a non-empty string",
                                  f"messages.{i}.role")
        parts.append(HEADER.format(role=role))
        parts.append(_content_text(message.get("content"), i))
        if not (continue_final_message and i == last):
            parts.append(END_OF_TURN)
    if add_generation_prompt:
        parts.append(HEADER.format(role="assistant"))
    return "".join(parts)


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ChatFormatError(f"messages[{index}].content[{j}]: expected an object "
                                      "with a type", f"messages.{index}.content.{j}")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ChatFormatError(f"messages[{index}].content[{j}].text: expected a "
                                          "string", f"messages.{index}.content.{j}.text")
                texts.append(part["text"])
        return "\n".join(texts)
    raise ChatFormatError(f"messages[{index}].content: expected a string or a list of parts",
                          f"messages.{index}.content")


def generation_offset(server_seed: int, request_seed: int | None, prompt: str) -> int:
    """Where in the corpus this request's text starts; also fixes its natural length."""
    digest = hashlib.blake2b(f"{server_seed}\x00{request_seed}\x00{prompt}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "big")


def natural_length(offset: int) -> int:
    """Tokens (the end-of-sequence token included) a model would write unprompted."""
    return MIN_NATURAL + (offset >> 20) % (MAX_NATURAL - MIN_NATURAL + 1)


def token_index(offset: int, position: int) -> int:
    """Vocabulary index of the output token at `position` (0-based) for `offset`."""
    return CORPUS[(offset + position) % CORPUS_LEN]


def generated_text(offset: int, count: int, ends_with_eos: bool) -> str:
    """The text of the first `count` output tokens; an end-of-sequence token adds nothing."""
    words = count - 1 if ends_with_eos else count
    start = offset % CORPUS_LEN
    return "".join(VOCABULARY[CORPUS[(start + i) % CORPUS_LEN]] for i in range(max(words, 0)))
