"""Sampling parameters, logprobs and echo at the gateway: what reaches the cluster, what comes back in OpenAI's
shapes, and what is refused. The real gateway over a real nats-server, with the SCRIPTED NATS PEER as workers."""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest

from spindle_protocol.messages import RequestSpec, StreamEvent, TokenLogprob

from .scripted_peer import ANSWER, MODEL, ScriptedPeer
from .test_gateway import CHAT, COMPLETION, assert_error, parse_sse, post


def test_sampling_fields_reach_the_cluster(gateway_url: str, peer: ScriptedPeer) -> None:
    body = {
        **CHAT,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.3,
        "logit_bias": {"42": -100, "7": 2.5},
        "min_tokens": 3,
        "min_p": 0.05,
        "max_tokens": 20,
        "logprobs": True,
        "top_logprobs": 3,
    }
    assert post(gateway_url, "/v1/chat/completions", body).status_code == 200
    assert post(gateway_url, "/v1/completions", {**COMPLETION, "logprobs": 2}).status_code == 200
    assert post(gateway_url, "/v1/chat/completions", {**CHAT, "logprobs": True}).status_code == 200
    assert post(gateway_url, "/v1/chat/completions", CHAT).status_code == 200
    chat, completion, chat_plain_logprobs, chat_none = (a.sampling for a in peer.admits)
    assert (chat.presence_penalty, chat.frequency_penalty, chat.repetition_penalty) == (0.5, -0.25, 1.3)
    assert chat.logit_bias == {42: -100.0, 7: 2.5}
    assert (chat.min_tokens, chat.min_p, chat.logprobs) == (3, 0.05, 3)
    assert completion.logprobs == 2 and chat_plain_logprobs.logprobs == 0 and chat_none.logprobs is None
    assert (chat_none.presence_penalty, chat_none.repetition_penalty, chat_none.logit_bias) == (0.0, 1.0, {})


REFUSED: list[tuple[str, str, dict[str, Any], str]] = [
    ("presence_penalty > 2", "/v1/chat/completions", {**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty < -2", "/v1/completions", {**COMPLETION, "frequency_penalty": -3}, "frequency_penalty"),
    ("repetition_penalty 0", "/v1/completions", {**COMPLETION, "repetition_penalty": 0}, "repetition_penalty"),
    ("logit_bias key a word", "/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias out of vocab", "/v1/chat/completions", {**CHAT, "logit_bias": {"49152": 1}}, "logit_bias"),
    ("logit_bias 200", "/v1/chat/completions", {**CHAT, "logit_bias": {"5": 200}}, "logit_bias"),
    ("min_p > 1", "/v1/completions", {**COMPLETION, "min_p": 1.5}, "min_p"),
    ("min_tokens > max_tokens", "/v1/completions", {**COMPLETION, "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ("top_logprobs alone", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs 21", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completion logprobs 21", "/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("echo logprobs n=2", "/v1/completions", {**COMPLETION, "echo": True, "logprobs": 1, "n": 2}, "n"),
    ("prompt_logprobs 21", "/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("best_of 2", "/v1/completions", {**COMPLETION, "best_of": 2}, "best_of"),
    ("suffix", "/v1/completions", {**COMPLETION, "suffix": "end"}, "suffix"),
    ("beam search", "/v1/completions", {**COMPLETION, "use_beam_search": True}, "use_beam_search"),
    ("tool_choice required", "/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_values_out_of_range_and_unsupported_fields_are_400_naming_the_field(
    gateway_url: str, peer: ScriptedPeer, path: str, body: dict[str, Any], param: str
) -> None:
    err = assert_error(post(gateway_url, path, body), 400)
    assert err["param"] == param and param in err["message"]
    assert peer.admits == []


def test_neutral_values_of_unsupported_fields_are_accepted(gateway_url: str, peer: ScriptedPeer) -> None:
    neutral = {"best_of": 1, "use_beam_search": False, "response_format": {"type": "text"}, "tool_choice": "none"}
    assert post(gateway_url, "/v1/chat/completions", {**CHAT, **neutral}).status_code == 200


def _logprob_script(peer: ScriptedPeer, top: int, banned_at: int | None = None):
    """The answer's tokens with made-up logprobs: position i has logprob -0.1 * (i + 1), its alternatives the
    next `top` token ids with lower logprobs; position `banned_at` has -inf (a banned token, as with min_tokens)."""
    tokens = peer.answer_tokens()

    def entry(i: int, t: int) -> TokenLogprob:
        lp = -math.inf if i == banned_at else -0.1 * (i + 1)
        return TokenLogprob(t, lp, [t + k for k in range(top)], [-0.1 * (i + 1) - k for k in range(top)])

    def script(spec: RequestSpec) -> list[StreamEvent]:
        return [
            StreamEvent(
                request_id=spec.request_id,
                seq=i,
                token_ids=[t],
                finished=i == len(tokens) - 1,
                finish_reason="stop" if i == len(tokens) - 1 else None,
                logprobs=[entry(i, t)],
            )
            for i, t in enumerate(tokens)
        ]

    return tokens, entry, script


def test_chat_logprobs_in_openai_shape_streamed_and_not(gateway_url: str, peer: ScriptedPeer, tokenizer) -> None:
    tokens, entry, peer.script = _logprob_script(peer, top=2, banned_at=1)
    body = {**CHAT, "logprobs": True, "top_logprobs": 2}
    whole = post(gateway_url, "/v1/chat/completions", body).json()["choices"][0]
    chunks = parse_sse(post(gateway_url, "/v1/chat/completions", {**body, "stream": True}).text)[:-1]
    streamed = [c for ch in chunks for c in ((ch["choices"][0].get("logprobs") or {}).get("content") or [])]
    assert whole["logprobs"]["content"] == streamed
    content = whole["logprobs"]["content"]
    assert len(content) == len(tokens)  # the EOS position too: it was sampled
    for i, (t, got) in enumerate(zip(tokens, content, strict=True)):
        want = entry(i, t)
        text = tokenizer.decode([t], skip_special_tokens=False)
        assert got["token"] == text and got["bytes"] == list(text.encode())
        assert got["logprob"] == (-9999.0 if i == 1 else pytest.approx(want.logprob))
        assert [a["logprob"] for a in got["top_logprobs"]] == pytest.approx(want.top_logprobs)
        assert [a["token"] for a in got["top_logprobs"]] == [
            tokenizer.decode([a], skip_special_tokens=False) for a in want.top_ids
        ]
    assert "".join(c["token"] for c in content[:-1]) == ANSWER


def test_completion_logprobs_in_openai_shape(gateway_url: str, peer: ScriptedPeer, tokenizer) -> None:
    tokens, entry, peer.script = _logprob_script(peer, top=1)
    body = {**COMPLETION, "logprobs": 1, "max_tokens": 50}
    lp = post(gateway_url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert lp["tokens"] == texts
    assert lp["token_logprobs"] == pytest.approx([entry(i, t).logprob for i, t in enumerate(tokens)])
    assert lp["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    for i, (t, top) in enumerate(zip(tokens, lp["top_logprobs"], strict=True)):
        assert top[texts[i]] == pytest.approx(entry(i, t).logprob)  # the sampled token, plus the alternative
    chunks = parse_sse(post(gateway_url, "/v1/completions", {**body, "stream": True}).text)[:-1]
    streamed = [x for ch in chunks for x in ((ch["choices"][0].get("logprobs") or {}).get("tokens") or [])]
    assert streamed == texts


def test_no_logprobs_asked_means_null(gateway_url: str, peer: ScriptedPeer) -> None:
    _, _, peer.script = _logprob_script(peer, top=0)  # even if a worker sent some
    assert post(gateway_url, "/v1/chat/completions", CHAT).json()["choices"][0]["logprobs"] is None


def test_echo_returns_the_prompt_before_the_completion(gateway_url: str, peer: ScriptedPeer, tokenizer) -> None:
    body = {**COMPLETION, "echo": True}
    assert post(gateway_url, "/v1/completions", body).json()["choices"][0]["text"] == COMPLETION["prompt"] + ANSWER
    chunks = parse_sse(post(gateway_url, "/v1/completions", {**body, "stream": True}).text)[:-1]
    assert chunks[0]["choices"][0]["text"] == COMPLETION["prompt"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == COMPLETION["prompt"] + ANSWER
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    echoed = post(gateway_url, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True}).json()
    assert echoed["choices"][0]["text"] == "Hello there" + ANSWER


def test_default_max_tokens_is_configurable(harness: Any, peer: ScriptedPeer) -> None:
    gw = harness.start_gateway(default_max_tokens=50)
    assert post(gw.url, "/v1/chat/completions", CHAT).status_code == 200
    assert post(gw.url, "/v1/chat/completions", {**CHAT, "max_tokens": 70}).status_code == 200
    assert post(gw.url, "/v1/completions", COMPLETION).status_code == 200
    assert [a.sampling.max_tokens for a in peer.admits] == [50, 70, 16]


def _choices_script(peer: ScriptedPeer, n: int, tokenizer):
    """n choices, interleaved event by event: choice i answers `ANSWER` with " (i)" appended before EOS."""

    def tokens(i: int) -> list[int]:
        return [*tokenizer.encode(f"{ANSWER} ({i})", add_special_tokens=False), 2]

    def script(spec: RequestSpec) -> list[StreamEvent]:
        per = [tokens(i) for i in range(n)]
        events = []
        for pos in range(max(map(len, per))):
            for i, ids in enumerate(per):
                if pos < len(ids):
                    last = pos == len(ids) - 1
                    events.append(
                        StreamEvent(
                            request_id=spec.request_id,
                            index=i,
                            seq=pos,
                            token_ids=[ids[pos]],
                            finished=last,
                            finish_reason="stop" if last else None,
                        )
                    )
        return events

    return tokens, script


def test_n_choices_streamed_and_not(gateway_url: str, peer: ScriptedPeer, tokenizer) -> None:
    tokens, peer.script = _choices_script(peer, 3, tokenizer)
    whole = post(gateway_url, "/v1/chat/completions", {**CHAT, "n": 3}).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in whole["choices"]] == [f"{ANSWER} ({i})" for i in range(3)]
    assert whole["usage"]["completion_tokens"] == sum(len(tokens(i)) for i in range(3))
    assert peer.admits[0].sampling.n == 3

    body = {**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    events = parse_sse(post(gateway_url, "/v1/chat/completions", body).text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] > 0
    texts = {i: "" for i in range(3)}
    roles, finishes = [], []
    for e in events[:-2]:
        (c,) = e["choices"]
        if c["delta"].get("role"):
            roles.append(c["index"])
        texts[c["index"]] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            finishes.append(c["index"])
    assert sorted(roles) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert texts == {i: f"{ANSWER} ({i})" for i in range(3)}


def test_a_stop_string_ends_only_its_choice(gateway_url: str, peer: ScriptedPeer, tokenizer) -> None:
    _, peer.script = _choices_script(peer, 2, tokenizer)
    body = {**COMPLETION, "n": 2, "stop": ["(1)"], "max_tokens": 50}
    choices = post(gateway_url, "/v1/completions", body).json()["choices"]
    assert [c["text"] for c in choices] == [f"{ANSWER} (0)", f"{ANSWER} "]
    assert [c["stop_reason"] for c in choices] == [None, "(1)"]


# ---- structured output ----

PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def test_structured_output_requests_carry_their_grammar(gateway_url: str, peer: ScriptedPeer) -> None:
    json_schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    bodies = [
        ("/v1/chat/completions", {**CHAT, "response_format": json_schema}),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}),
        ("/v1/completions", {**COMPLETION, "guided_json": PERSON}),
        ("/v1/completions", {**COMPLETION, "guided_regex": "[0-9]+"}),
        ("/v1/completions", {**COMPLETION, "guided_choice": ["yes", "no?"]}),
        ("/v1/chat/completions", {**CHAT, "tools": [WEATHER, CLOCK], "tool_choice": "required"}),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        ),
        ("/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": "none"}),
    ]
    for path, body in bodies:
        assert post(gateway_url, path, body).status_code == 200, body
    grammars = [a.sampling.grammar for a in peer.admits]
    assert [(g.kind if g else None) for g in grammars] == [
        *["json_schema"] * 3,
        "regex",
        "regex",
        "json_schema",
        "json_schema",
        None,
    ]
    assert json.loads(grammars[0].source) == PERSON and json.loads(grammars[1].source) == {"type": "object"}
    assert grammars[4].source == r"yes|no\?"
    required = json.loads(grammars[5].source)["anyOf"]
    assert [s["properties"]["name"]["const"] for s in required] == ["get_weather", "get_time"]
    named = json.loads(grammars[6].source)
    # only the declared arguments, as OpenAI's strict mode
    assert named["properties"]["arguments"] == {**WEATHER["function"]["parameters"], "additionalProperties": False}


STRUCTURE_REFUSED: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "bad schema",
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objecxt"}}},
        },
        "response_format",
    ),
    ("format type", "/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, "response_format"),
    ("bad regex", "/v1/completions", {**COMPLETION, "guided_regex": "(ab"}, "guided_regex"),
    ("empty choice", "/v1/completions", {**COMPLETION, "guided_choice": []}, "guided_choice"),
    ("two structures", "/v1/completions", {**COMPLETION, "guided_regex": "a", "guided_json": PERSON}, "guided_regex"),
    ("tools auto", "/v1/chat/completions", {**CHAT, "tools": [WEATHER]}, "tool_choice"),
    (
        "unknown tool",
        "/v1/chat/completions",
        {**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ("bad tool", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ("guided_grammar", "/v1/completions", {**COMPLETION, "guided_grammar": "root ::= 'a'"}, "guided_grammar"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in STRUCTURE_REFUSED], ids=[c[0] for c in STRUCTURE_REFUSED]
)
def test_bad_structures_are_400_naming_the_field(
    gateway_url: str, peer: ScriptedPeer, path: str, body: dict[str, Any], param: str
) -> None:
    err = assert_error(post(gateway_url, path, body), 400)
    assert err["param"] == param, err
    assert peer.admits == []


def test_a_constrained_call_comes_back_as_tool_calls(gateway_url: str, peer: ScriptedPeer, tokenizer) -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    tokens = [*tokenizer.encode(call, add_special_tokens=False), 2]
    peer.script = lambda spec: [
        StreamEvent(request_id=spec.request_id, seq=i, token_ids=[t], finished=i == len(tokens) - 1,
                    finish_reason="stop" if i == len(tokens) - 1 else None)
        for i, t in enumerate(tokens)
    ]  # fmt: skip
    body = {**CHAT, "tools": [WEATHER], "tool_choice": "required"}
    choice = post(gateway_url, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (tc,) = choice["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["id"].startswith("call_")
    assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
    events = parse_sse(post(gateway_url, "/v1/chat/completions", {**body, "stream": True}).text)[:-1]
    deltas = [e["choices"][0] for e in events]
    assert not any(d["delta"].get("content") for d in deltas)
    (last,) = [d for d in deltas if d["finish_reason"]]
    assert last["finish_reason"] == "tool_calls"
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_echo_with_logprobs_and_prompt_logprobs(gateway_url: str, peer: ScriptedPeer, tokenizer) -> None:
    """The prompt's logprobs come with the first output's event (from the prefill instance); echo + logprobs puts
    them first in OpenAI's completions shape, `prompt_logprobs` is vLLM's per-choice list."""
    prompt = tokenizer.encode(COMPLETION["prompt"], add_special_tokens=False)
    tokens, _, script = _logprob_script(peer, top=1)
    prompt_lps = [TokenLogprob(t, -1.0 - i, [t + 1], [-2.0 - i]) for i, t in enumerate(prompt[1:])]

    def with_prompt(spec: RequestSpec) -> list[StreamEvent]:
        events = script(spec)
        return [msgspec.structs.replace(events[0], prompt_logprobs=prompt_lps), *events[1:]]

    peer.script = with_prompt
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 50}
    choice = post(gateway_url, "/v1/completions", body).json()["choices"][0]
    assert peer.admits[-1].sampling.prompt_logprobs == 1
    lp = choice["logprobs"]
    n = len(prompt)
    assert lp["tokens"][:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
    assert lp["token_logprobs"][:n] == [None, *[-1.0 - i for i in range(n - 1)]]
    assert lp["top_logprobs"][0] is None and len(lp["tokens"]) == n + len(tokens)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(COMPLETION["prompt"])
    assert choice["text"].startswith(COMPLETION["prompt"])
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1][str(prompt[1])]["logprob"] == -1.0

    chunks = parse_sse(post(gateway_url, "/v1/completions", {**body, "stream": True}).text)[:-1]
    streamed = [t for c in chunks for t in ((c["choices"][0].get("logprobs") or {}).get("tokens") or [])]
    assert streamed == lp["tokens"]
    vllm = post(gateway_url, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0}).json()["choices"][0]
    assert vllm["prompt_logprobs"][0] is None and len(vllm["prompt_logprobs"]) == n
