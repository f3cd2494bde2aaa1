"""Tokenizer wrapper (encode/decode, chat template, special ids) and incremental detokenization."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from spindle_tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE = "naïve café — 東京 🎉"
TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    MULTIBYTE,
    "mixed: 2024年3月 — ça va? 👩‍💻 ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def test_special_ids_and_vocab(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.bos_token_id == 1
    assert 2 in tok.eos_token_ids and len(set(tok.eos_token_ids)) == len(tok.eos_token_ids)
    assert tok.vocab_size == 49152
    assert tok.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"
    assert tok.decode([1, 2]) == ""


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(smollm2_tokenizer: Tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert smollm2_tokenizer.decode(ids) == text
    # SmolLM2 adds no BOS by itself (its chat template writes <|im_start|>).
    assert smollm2_tokenizer.encode(text, add_special_tokens=False) == ids


def test_chat_template(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.render_chat(messages)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system prompt
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> is one special token, not spelled out
    assert tok.decode(ids, skip_special_tokens=False) == text
    no_prompt = tok.render_chat(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n") and text.startswith(no_prompt)
    with pytest.raises(ValueError, match="must be a dict"):
        tok.render_chat([{"role": "user"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.render_chat([])


def test_no_chat_template(smollm2_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    tok = Tokenizer(tmp_path)
    assert not tok.has_chat_template
    assert tok.decode(tok.encode(MULTIBYTE)) == MULTIBYTE
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        Tokenizer(tmp_path)


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_multibyte(smollm2_tokenizer: Tokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    pieces, rest = _stream(smollm2_tokenizer, ids)
    assert "".join(pieces) + rest == smollm2_tokenizer.decode(ids) == text
    assert rest == ""  # the text ends on a complete character
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_holds_back_partial_characters(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits the emoji's 4 UTF-8 bytes over several tokens
    pieces, rest = _stream(smollm2_tokenizer, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉" and rest == ""
    # A stream cut inside a character: nothing is emitted until flush, which returns what decode() gives.
    pieces, rest = _stream(smollm2_tokenizer, ids[:-1])
    assert pieces == [""] * (len(ids) - 1)
    assert rest == smollm2_tokenizer.decode(ids[:-1]) and rest.endswith("\ufffd")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_chat(smollm2_tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    tok = smollm2_tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": MULTIBYTE}], add_generation_prompt=False)
    pieces, rest = _stream(tok, ids, skip_special_tokens)
    assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_exact_on_random_ids(smollm2_tokenizer: Tokenizer) -> None:
    # Random ids include lone UTF-8 fragments and special tokens: the pieces must still add up to decode().
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(smollm2_tokenizer.vocab_size) for _ in range(200)]
        for skip in (True, False):
            pieces, rest = _stream(smollm2_tokenizer, ids, skip)
            assert "".join(pieces) + rest == smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
