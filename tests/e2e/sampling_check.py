"""One penalised, biased, seeded request with logprobs, run through a stack and through the single engine: the
stack must give the engine's tokens exactly and its logprobs within fp32 tolerance, whichever instance sampled
each token (the prefill instance the first, a decode instance, a TP leader or a KVP master the rest)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from .sse import read_events

LOGPROB_TOL = 2e-3  # logits of parallel paths agree within ~1e-4; log_softmax keeps that order


def penalised_body(prompt: list[int], max_tokens: int, banned: int, logprobs: int = 3) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": 4321,
        "top_k": 50,
        "min_p": 0.02,
        "presence_penalty": 0.6,
        "frequency_penalty": 0.4,
        "repetition_penalty": 1.3,
        "logit_bias": {str(banned): -100},
        "min_tokens": max_tokens // 2,
        "logprobs": logprobs,
    }


def engine_reference(engine: Any, body: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """The single engine's tokens and per-token logprobs for `body` (a completions body with token ids)."""
    from spindle_engine import SamplingParams

    params = SamplingParams(
        max_tokens=body["max_tokens"],
        temperature=body["temperature"],
        seed=body["seed"],
        top_k=body["top_k"],
        min_p=body["min_p"],
        presence_penalty=body["presence_penalty"],
        frequency_penalty=body["frequency_penalty"],
        repetition_penalty=body["repetition_penalty"],
        logit_bias=tuple((int(k), float(v)) for k, v in body["logit_bias"].items()),
        min_tokens=body["min_tokens"],
        logprobs=body["logprobs"],
    )
    rid = f"ref-sampled-{time.monotonic_ns()}"
    engine.add_request(rid, body["prompt"], params)
    tokens: list[int] = []
    logprobs: list[Any] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                logprobs += o.logprobs or []
    return tokens, logprobs


def stream_completion(base_url: str, body: dict[str, Any], timeout: float = 300) -> list[Any]:
    with httpx.stream("POST", base_url + "/completions", timeout=timeout, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return read_events(r)


def assert_stream_matches(events: list[Any], tokenizer: Any, tokens: list[int], logprobs: list[Any]) -> None:
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e.get("choices")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0].get("logprobs")]
    got_tokens = [t for lp in lps for t in lp["tokens"]]
    got_values = [v for lp in lps for v in lp["token_logprobs"]]
    got_tops = [top for lp in lps for top in lp["top_logprobs"]]
    assert text == tokenizer.decode(tokens)
    assert got_tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert got_values == pytest.approx([lp.logprob for lp in logprobs], abs=LOGPROB_TOL)
    for top, want in zip(got_tops, logprobs, strict=True):
        for t, value in zip(want.top_ids, want.top_logprobs, strict=True):
            assert top[tokenizer.decode([t], skip_special_tokens=False)] == pytest.approx(value, abs=LOGPROB_TOL)


def engine_tokens(engine: Any, prompt: list[int], params: Any) -> list[int]:
    """The single engine's output tokens for one request."""
    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params)
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out


WORDS_REGEX = "( [a-z]+){24}\\."  # 24 lowercase words and a full stop: a long output any prompt can continue
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def check_person(text: str) -> None:
    import json

    obj = json.loads(text)
    assert set(obj) == {"name", "age", "city"} and obj["city"] in ("Paris", "Rome", "Oslo"), obj
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and len(obj["name"]) <= 20, obj
