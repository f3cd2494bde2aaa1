"""The official `openai` client, unchanged, against the gateway on a real port (SCRIPTED NATS PEER behind it)."""

from __future__ import annotations

import openai
import pytest

from spindle_protocol.messages import AdmitReply

from .scripted_peer import ANSWER, MODEL, ScriptedPeer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(gateway_url: str) -> openai.OpenAI:
    c = openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0, timeout=10)
    yield c
    c.close()


def test_chat_non_stream_and_stream(client: openai.OpenAI, peer: ScriptedPeer) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    assert resp.choices[0].message.content == ANSWER and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop" and resp.object == "chat.completion"
    assert resp.usage.completion_tokens == len(peer.answer_tokens())

    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_completions_non_stream_and_stream(client: openai.OpenAI, peer: ScriptedPeer) -> None:
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=16)
    assert resp.choices[0].text == ANSWER and resp.object == "text_completion"
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_and_errors(client: openai.OpenAI, peer: ScriptedPeer) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=QUESTION)
    peer.admit_reply = AdmitReply(accepted=False, status=429, reason="busy", retry_after_s=1)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x")
    assert len(peer.admits) == 1
