"""The prompt-length bound (tokenization.py) on the real SmolLM2 tokenizer and on tokenizer.json variants, the bound
on concurrent thread tokenizations, and the `usage.spindle` key set against what the workers write."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spindle_gateway import tokenization
from spindle_gateway.sse import SPINDLE_USAGE_KEYS
from spindle_gateway.tokenization import PromptTooLong, chars_per_token, tokenizer_facts

REPO = Path(__file__).resolve().parents[3]


def bpe(**model: Any) -> dict[str, Any]:
    return {"model": {"type": "BPE", "vocab": {"a": 0, "abcd": 1, "<unk>": 2}, "unk_token": "<unk>", **model}}


def test_smollm2_bound_is_its_longest_token(tokenizer: Any) -> None:
    facts = tokenizer_facts(Path(tokenizer.path))
    assert facts.chars_per_token == 81  # "\n" and 80 spaces, in the byte-level alphabet
    assert facts.token_strings[tokenizer.encode(" capital", add_special_tokens=False)[0]] == "Ġcapital"


@pytest.mark.parametrize(
    "text",
    [
        "#" * 80 * 50,
        "\n" + " " * 80,
        ("\n" + " " * 80) * 40,
        "=" * 10_000,
        " " * 10_000,
        "<|im_start|><|im_end|>" * 100,
        "🙂" * 500,
        "日本語のテキスト" * 200,
        "The capital of France is Paris. " * 300,
    ],
)
def test_the_bound_holds_on_adversarial_text(tokenizer: Any, text: str) -> None:
    bound = tokenizer_facts(Path(tokenizer.path)).chars_per_token
    assert bound is not None
    for add in (False, True):
        assert len(tokenizer.encode(text, add)) >= math.ceil(len(text) / bound)


def test_prompts_that_fit_are_tokenized_exactly(tokenizer: Any) -> None:
    text = ("\n" + " " * 80) * 63  # 63 tokens of 81 characters: the densest text there is, exactly at the bound
    ids = asyncio.run(tokenization.encode(tokenizer, text, True, limit=64))
    assert ids == tokenizer.encode(text) and len(ids) == 63
    with pytest.raises(PromptTooLong) as info:  # 63 tokens leave no room in a context of 63
        asyncio.run(tokenization.encode(tokenizer, text, True, limit=63))
    assert info.value.at_least == 63 and info.value.chars == 81 * 63


@pytest.mark.parametrize(
    ("spec", "bound"),
    [
        (bpe(), 5),  # "<unk>": one unknown character each
        (bpe(fuse_unk=True), None),  # a run of unknown characters is one token
        (bpe(unk_token=None), None),  # unknown characters vanish
        (bpe(unk_token=None, byte_fallback=True), 5),
        ({**bpe(unk_token=None), "pre_tokenizer": {"type": "ByteLevel"}}, 5),
        ({**bpe(), "normalizer": {"type": "NFC"}}, 20),
        ({**bpe(), "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}}, 20),
        (
            {**bpe(), "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}},
            5,
        ),
        ({**bpe(), "normalizer": {"type": "Replace", "pattern": {"String": "ab"}, "content": "c"}}, 10),
        ({**bpe(), "normalizer": {"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}}, None),
        ({**bpe(), "normalizer": {"type": "Replace", "pattern": {"String": "x"}, "content": ""}}, None),
        ({**bpe(), "normalizer": {"type": "BertNormalizer"}}, None),
        ({**bpe(), "normalizer": {"type": "Strip"}}, None),
        ({**bpe(), "pre_tokenizer": {"type": "Whitespace"}}, None),
        ({**bpe(), "pre_tokenizer": {"type": "Split", "behavior": "Removed"}}, None),
        (
            {
                **bpe(),
                "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split"}, {"type": "ByteLevel"}]},
            },
            5,
        ),
        ({**bpe(), "added_tokens": [{"id": 3, "content": "<|a_long_special|>"}]}, 18),
        ({**bpe(), "added_tokens": [{"id": 3, "content": "<mask>", "lstrip": True}]}, None),
        ({**bpe(), "truncation": {"max_length": 8}}, None),
        ({"model": {"type": "WordPiece", "vocab": {"a": 0}}}, None),
    ],
)
def test_bound_from_tokenizer_json(spec: dict[str, Any], bound: float | None) -> None:
    assert chars_per_token(spec) == bound


def test_tokens_added_by_the_config_count() -> None:
    assert chars_per_token(bpe(), {"eos_token": "<|a_very_long_end|>"}) == 19
    assert chars_per_token(bpe(), {"added_tokens_decoder": {"3": {"content": "<m>", "rstrip": True}}}) is None


def test_thread_tokenizations_are_bounded() -> None:
    running = peak = 0
    lock = threading.Lock()

    def work(_: str, __: bool) -> list[int]:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return [1]

    class Slow:
        path = None
        encode = staticmethod(work)

    async def main() -> None:
        text = "x" * (tokenization.THREAD_CHARS + 1)
        await asyncio.gather(*(tokenization.encode(Slow(), text, True, limit=10) for _ in range(8)))

    asyncio.run(main())
    assert peak == tokenization.THREAD_SLOTS


def test_usage_keys_cover_every_stat_the_workers_write() -> None:
    written = set()
    for root in ("services/prefill", "services/decode", "libs/worker"):
        for path in (REPO / root).rglob("*.py"):
            written |= set(re.findall(r"""stats\[["'](\w+)["']\]""", path.read_text()))
    assert written and written <= set(SPINDLE_USAGE_KEYS), written - set(SPINDLE_USAGE_KEYS)
