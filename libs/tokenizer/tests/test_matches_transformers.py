"""The torch-free tokenizer gives what Hugging Face transformers' AutoTokenizer gives on the same directory: ids,
text, special ids and rendered chat templates (the SmolLM2 conversion, and variants of its tokenizer files)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from spindle_tokenizer import Tokenizer

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "naïve café — 東京 🎉 👩‍💻 ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text between specials<|im_end|><|im_end|>",
    "a<|im_start|>b <|im_end|> c",
    "",
    " ",
    '1234567890 3.14159 x=y+z; {"json": [1, 2]}',
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🎉"}],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "<|im_end|> three"},
    ],
]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    path.write_text(json.dumps(data))


def assert_same(path: Path, chats: list[list[dict[str, Any]]] = CHATS) -> Tokenizer:
    hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    tok = Tokenizer(path)
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, special) == hf.encode(text, add_special_tokens=special), (text, special)
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(40)]
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert tok.decode(ids, skip) == expected
    assert tok.vocab_size == len(hf)
    assert tok.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in tok.eos_token_ids
    assert tok.has_chat_template == bool(hf.chat_template)
    if tok.has_chat_template:
        for chat in chats:
            for gen in (True, False):
                text = tok.render_chat(chat, gen)
                assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
                ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=False)
                assert tok.apply_chat_template(chat, gen) == list(ids)
    return tok


def test_smollm2(smollm2_dir: Path) -> None:
    tok = assert_same(smollm2_dir)
    assert tok.special_tokens["eos_token"] == "<|im_end|>"


def test_template_in_tokenizer_config(smollm2_dir: Path, tmp_path: Path) -> None:
    d = _copy(smollm2_dir, tmp_path / "m")
    template = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    _edit_json(d / "tokenizer_config.json", chat_template=template)
    assert Tokenizer(d).chat_template == template
    assert_same(d)
    # A list of named templates: "default" is the one used.
    other = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    named = [{"name": "tool_use", "template": other}, {"name": "default", "template": template}]
    _edit_json(d / "tokenizer_config.json", chat_template=named)
    assert Tokenizer(d).chat_template == template


def test_tokenizer_json_post_processor_wins(smollm2_dir: Path, tmp_path: Path) -> None:
    # transformers >= 5 ignores add_bos_token / add_eos_token when tokenizer.json is there: so does this one.
    d = _copy(smollm2_dir, tmp_path / "m")
    _edit_json(d / "tokenizer_config.json", add_bos_token=True, add_eos_token=True)
    tok = assert_same(d)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False) == Tokenizer(smollm2_dir).encode("hi")


def test_special_token_missing_from_tokenizer_json(smollm2_dir: Path, tmp_path: Path) -> None:
    d = _copy(smollm2_dir, tmp_path / "m")
    _edit_json(d / "tokenizer_config.json", mask_token="<|mask|>")
    tok = assert_same(d)
    assert tok.vocab_size == 49153 and tok.encode("a<|mask|>", False)[-1] == 49152
    assert tok.decode([49152]) == "" and tok.decode([49152], skip_special_tokens=False) == "<|mask|>"


def test_template_features(smollm2_dir: Path, tmp_path: Path) -> None:
    """What transformers' template environment provides: trim/lstrip blocks, loop controls, a non-escaping
    tojson, namespace, raise_exception, {% generation %}, and the special tokens as variables."""
    d = _copy(smollm2_dir, tmp_path / "m")
    template = """{{ bos_token }}
{%- set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'tool' %}{{ raise_exception('no tools here: ' + m.content) }}{% endif %}
    {% if m.content == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}
    {% else %}{{ m.role }}: {{ m | tojson }}
    {% endif %}
{% endfor %}
{{ ns.n }} {{ dict(a=1) | tojson }}{% if add_generation_prompt %}<go>{% endif %}"""
    (d / "chat_template.jinja").write_text(template)
    chats = [
        [{"role": "user", "content": '<b>ünï</b> & "q"'}, {"role": "user", "content": "skip"}],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],
    ]
    tok = assert_same(d, chats)
    with pytest.raises(ValueError, match="no tools here: boom"):
        tok.render_chat([{"role": "tool", "content": "boom"}])


def test_generation_defaults(smollm2_dir: Path, tmp_path: Path) -> None:
    assert Tokenizer(smollm2_dir).generation_defaults == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    d = _copy(smollm2_dir, tmp_path / "m")
    sampling = {"temperature": 0.2, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1, "max_new_tokens": 64}
    _edit_json(d / "generation_config.json", transformers_version="4.0", eos_token_id=[2, 0], **sampling)
    tok = Tokenizer(d)
    defaults = tok.generation_defaults
    assert defaults == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2, **sampling}
    defaults["temperature"] = 5.0
    defaults["eos_token_id"].append(7)
    assert tok.generation_defaults["temperature"] == 0.2 and tok.generation_defaults["eos_token_id"] == [2, 0]
    assert tok.eos_token_ids == (2, 0)
    (d / "generation_config.json").unlink()
    assert Tokenizer(d).generation_defaults == {}
