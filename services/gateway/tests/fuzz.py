"""schemathesis' generated cases (valid and invalid) for operations of the gateway's /openapi.json, drawn from its
strategies (its pytest plugin does not run on pytest 9): no 5xx, no hang, every 4xx in the OpenAI error shape."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


def fuzz(base_url: str, operations: list, examples: int) -> dict[int, int]:
    """Run `examples` cases per operation and mode against `base_url`; returns the calls by status."""
    calls: dict[int, int] = {}

    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, timeout=10)  # a hang fails here
        calls[response.status_code] = calls.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
        if response.status_code >= 400 and case.method != "HEAD":
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code

    for operation in operations:
        for mode in MODES:
            run = settings(
                max_examples=examples, deadline=None, print_blob=False, suppress_health_check=list(HealthCheck)
            )(given(case=operation.as_strategy(generation_mode=mode))(check))
            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body): only positive cases
                assert mode is schemathesis.GenerationMode.NEGATIVE, operation.label
    return calls
