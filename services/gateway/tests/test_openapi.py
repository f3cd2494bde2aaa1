"""`/openapi.json` documents every request body and error response, and a schemathesis run over it (bounded
cases, positive and negative) finds no 5xx, no hang and no 4xx without an OpenAI error body. The real gateway over
a real nats-server, with the SCRIPTED NATS PEER as workers (valid requests get its answer)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis

from .fuzz import fuzz
from .scripted_peer import ScriptedPeer

EXAMPLES = 40  # per operation and mode
POSTS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize")


@pytest.fixture
def spec(gateway_url: str) -> dict[str, Any]:
    return httpx.get(gateway_url + "/openapi.json", timeout=10).json()


def test_every_request_body_and_error_is_documented(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    for path in POSTS:
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in schemas
        assert {"400", "413"} <= set(op["responses"]) and "422" not in op["responses"]
        error = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("/ErrorResponse")
    chat = schemas["ChatCompletionRequest"]["properties"]
    for field in ("messages", "logprobs", "top_logprobs", "logit_bias", "presence_penalty", "n", "min_tokens"):
        assert field in chat, field
    assert "echo" in schemas["CompletionRequest"]["properties"]
    assert set(schemas["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}
    assert "404" in spec["paths"]["/v1/models/{model_id}"]["get"]["responses"]


@pytest.mark.slow
def test_fuzzed_requests_get_no_5xx_no_hang_and_error_json(gateway_url: str, peer: ScriptedPeer) -> None:
    """schemathesis' generated cases for every operation, valid and invalid (its pytest plugin does not run on
    pytest 9, so the cases are drawn from its strategies here)."""
    schema = schemathesis.openapi.from_url(gateway_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    calls = fuzz(gateway_url, operations, EXAMPLES)
    print(f"\nschemathesis: {sum(calls.values())} calls over {len(operations)} operations, by status {calls}")
    assert sum(v for k, v in calls.items() if k < 300) > 0 and sum(v for k, v in calls.items() if k >= 400) > 0
