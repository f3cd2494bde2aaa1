"""Constrained decoding with llguidance on the real SmolLM2 tokenizer: JSON schemas and regular expressions hold
under greedy and seeded sampling over random logits and with the real model; a state rebuilt from the outputs
gives the live state's mask; invalid grammars are ValueErrors."""

from __future__ import annotations

import json

import pytest
import torch

from spindle_engine import Engine, EngineConfig, SamplingParams
from spindle_engine.grammar import GrammarCompiler, check_grammar
from spindle_engine.sampler import process_logits, sample
from spindle_engine.sequence import Sequence
from spindle_model import resolve_model
from spindle_tokenizer import Tokenizer

V = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("smollm2").path


@pytest.fixture(scope="module")
def compiler(model_dir) -> GrammarCompiler:
    return GrammarCompiler.for_model_dir(model_dir, V, [EOS])


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


def _run(compiler, params: SamplingParams, seed: int, steps: int = 200) -> list[int]:
    """Sample `params`' grammar over random logits (biased to end strings soon) until EOS."""
    seq = Sequence("r", [1, 2, 3], params)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(1, V, generator=g) * 4
        logits[0, [EOS, 1, 7, 16]] += 6  # EOS and a few short tokens (`"`, `,`...) likelier: outputs stay short
        token = sample(logits, [seq], torch.Generator().manual_seed(seed), [EOS], compiler).tokens[0]
        seq.token_ids.append(token)
        if token == EOS:
            return seq.output_token_ids[:-1]
    raise AssertionError(f"no EOS after {steps} tokens")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_parse_and_validate(compiler, tokenizer, temperature):
    params = SamplingParams(
        max_tokens=300, temperature=temperature, seed=3, grammar=("json_schema", json.dumps(SCHEMA))
    )
    for seed in range(3):
        obj = json.loads(tokenizer.decode(_run(compiler, params, seed)))
        assert set(obj) == set(SCHEMA["required"])
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
        assert obj["color"] in ("red", "green", "blue")
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and all(isinstance(t, str) for t in obj["tags"])


def test_regex_and_json_object(compiler, tokenizer):
    regex = SamplingParams(max_tokens=50, temperature=1.0, seed=1, grammar=("regex", r"(yes|no), [0-9]{2}"))
    for seed in range(3):
        text = tokenizer.decode(_run(compiler, regex, seed))
        assert text[:4] in ("yes,", "no, ") and text[-2:].isdigit() and len(text) in (6, 7)
    anything = SamplingParams(max_tokens=300, temperature=1.0, seed=1, grammar=("json_schema", '{"type": "object"}'))
    assert isinstance(json.loads(tokenizer.decode(_run(compiler, anything, 5))), dict)


def test_a_state_rebuilt_from_the_outputs_masks_as_the_live_one(compiler):
    params = SamplingParams(temperature=1.0, seed=2, grammar=("json_schema", json.dumps(SCHEMA)), max_tokens=300)
    outputs = _run(compiler, params, 4)
    live = Sequence("a", [1, 2, 3], params)
    row = torch.randn(V, generator=torch.Generator().manual_seed(0))
    for k in range(len(outputs)):
        masked = process_logits(row, live, [EOS], compiler)
        rebuilt = process_logits(
            row, Sequence("b", [1, 2, 3, *outputs[:k]], params, num_prompt_tokens=3), [EOS], compiler
        )
        assert torch.equal(masked, rebuilt)
        assert torch.isfinite(masked[outputs[k]])  # what was sampled was allowed
        live.token_ids.append(outputs[k])


def test_min_tokens_never_bans_the_only_token_the_grammar_allows(compiler):
    params = SamplingParams(temperature=0, grammar=("regex", "ok"), min_tokens=10, max_tokens=20)
    seq = Sequence("r", [1], params)
    row = torch.zeros(V)
    for _ in range(5):
        token = sample(row[None], [seq], torch.Generator(), [EOS], compiler).tokens[0]
        seq.token_ids.append(token)
        if token == EOS:
            break
    assert seq.token_ids[-1] == EOS


@pytest.mark.parametrize(
    ("kind", "source", "match"),
    [
        ("json_schema", '{"type": "objecxt"}', "objecxt"),
        ("json_schema", "not json", "not valid JSON"),
        ("json_schema", '{"type": "string", "pattern": "[a-z"}', "unclosed"),
        ("regex", "(red", "unclosed group"),
        ("lark", "start: /a/", "kind"),
    ],
)
def test_invalid_grammars_are_value_errors(kind, source, match):
    with pytest.raises(ValueError, match=match):
        check_grammar(kind, source)


def test_the_engine_generates_schema_json_with_the_real_model(tokenizer):
    engine = Engine(EngineConfig(model="smollm2", kv_cache_tokens=2048, max_model_len=1024))
    messages = [{"role": "user", "content": "Describe a person as JSON with name, age, color and tags."}]
    prompt = tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)
    params = SamplingParams(max_tokens=120, temperature=0, grammar=("json_schema", json.dumps(SCHEMA)))
    engine.add_request("p", prompt, params)
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
    assert out[-1] == EOS
    obj = json.loads(tokenizer.decode(out))
    assert set(obj) == set(SCHEMA["required"]) and obj["color"] in ("red", "green", "blue")


def test_a_grammar_that_cannot_be_applied_ends_its_request_and_only_it(compiler):
    """No compiler on this engine (an in-memory model): the request ends at EOS; its neighbour is untouched."""
    constrained = Sequence("c", [1, 2], SamplingParams(temperature=0, grammar=("regex", "a+")))
    plain = Sequence("p", [1, 2], SamplingParams(temperature=0))
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [constrained, plain], torch.Generator(), [EOS], None).tokens
    assert out == [EOS, int(logits[1].argmax())]
