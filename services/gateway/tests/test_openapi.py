"""`/openapi.json` documents every request body and error response, and a schemathesis run over it (bounded
cases, positive and negative) finds no 5xx, no hang and no 4xx without an OpenAI error body. The real gateway over
a real nats-server, with the SCRIPTED NATS PEER as workers (valid requests get its answer)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

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


MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


@pytest.mark.slow
def test_fuzzed_requests_get_no_5xx_no_hang_and_error_json(gateway_url: str, peer: ScriptedPeer) -> None:
    """schemathesis' generated cases for every operation, valid and invalid (its pytest plugin does not run on
    pytest 9, so the cases are drawn from its strategies here)."""
    schema = schemathesis.openapi.from_url(gateway_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    calls: dict[int, int] = {}

    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=gateway_url, timeout=10)  # a hang fails here
        calls[response.status_code] = calls.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400 and case.method != "HEAD":
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code

    for operation in operations:
        for mode in MODES:
            run = settings(
                max_examples=EXAMPLES, deadline=None, print_blob=False, suppress_health_check=list(HealthCheck)
            )(given(case=operation.as_strategy(generation_mode=mode))(check))
            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body): only positive cases
                assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
    print(f"\nschemathesis: {sum(calls.values())} calls over {len(operations)} operations, by status {calls}")
    assert sum(v for k, v in calls.items() if k < 300) > 0 and sum(v for k, v in calls.items() if k >= 400) > 0
