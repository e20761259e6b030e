"""The tokenizer, chat template and generator: stable counts, prefix-stable block hashes,
deterministic text."""

from __future__ import annotations

import re

import pytest

from enginesim.tokenizer import (
    VOCABULARY,
    ChatFormatError,
    block_hashes,
    count_tokens,
    decode,
    encode,
    generated_text,
    generation_offset,
    natural_length,
    render_chat,
    token_index,
)


@pytest.mark.parametrize(("text", "tokens"), [("", 0), ("a", 1), ("abcd", 1), ("abcde", 2),
                                              ("The capital of France is", 6)])
def test_a_token_is_four_characters(text: str, tokens: int) -> None:
    assert count_tokens(text) == tokens


def test_prompts_sharing_a_beginning_share_its_block_hashes() -> None:
    system = "You are a careful assistant for a logistics company. " * 4  # 212 chars
    a = block_hashes(system + "Where is my parcel?")
    b = block_hashes(system + "Cancel my order, please.")
    assert len(a) == len(b) == 3
    assert a[:3] == b[:3]
    assert block_hashes(system + "x" * 100)[:3] == a[:3]


def test_only_full_blocks_have_hashes() -> None:
    assert block_hashes("z" * 63) == []
    assert len(block_hashes("z" * 64)) == 1


def test_the_chat_template_wraps_each_turn_and_opens_the_assistant_turn() -> None:
    prompt = render_chat([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert prompt == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                      "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize(("messages", "where"), [
    (["hello"], "messages[0]"),
    ([{"content": "no role"}], "messages[0].role"),
    ([{"role": "user", "content": 42}], "messages[0].content"),
    ([{"role": "user", "content": [{"text": "untyped"}]}], "messages[0].content[0]"),
])
def test_a_malformed_message_is_named(messages: list[object], where: str) -> None:
    with pytest.raises(ChatFormatError, match="^" + re.escape(where) + ":"):
        render_chat(messages)


def test_the_same_request_and_seed_give_the_same_text() -> None:
    offset = generation_offset(7, None, "prompt")
    assert generated_text(offset, 20, False) == generated_text(
        generation_offset(7, None, "prompt"), 20, False)
    assert generation_offset(8, None, "prompt") != offset
    assert generation_offset(7, 1, "prompt") != offset


def test_streamed_tokens_spell_the_whole_text_and_eos_adds_nothing() -> None:
    offset = generation_offset(0, 3, "p")
    streamed = "".join(VOCABULARY[token_index(offset, i)] for i in range(9))
    assert generated_text(offset, 9, False) == streamed
    assert generated_text(offset, 10, True) == streamed


def test_natural_lengths_vary_within_bounds() -> None:
    lengths = {natural_length(generation_offset(0, None, str(i))) for i in range(200)}
    assert min(lengths) >= 32 and max(lengths) <= 512 and len(lengths) > 50


def test_token_ids_round_trip_and_ascii_ids_are_the_same_everywhere() -> None:
    text = "Hello, Meridian — ünïcode too."
    ids = encode(text)
    assert len(ids) == count_tokens(text) and decode(ids) == text
    assert encode("abcd") == [(97 << 21) | (98 << 14) | (99 << 7) | 100]
    assert decode(encode("ab")) == "ab" and encode("ab") != encode("ab\x00\x00")


def test_every_id_below_2_28_is_four_characters_and_an_unknown_id_is_empty() -> None:
    assert all(len(decode([i])) == 4 for i in (0, 1, 19556, (1 << 28) - 1))
    assert decode([(1 << 29) + (1 << 20) + 5]) == ""


def test_a_continued_final_message_is_left_open() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert render_chat(messages, False, True).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\nHel")
