"""`/openapi.json`: every request body and every error response, from the pydantic models that validate them.

The routes read their bodies themselves (schemas.parse_body: every failure is a 400 in OpenAI's shape, never
FastAPI's 422), so FastAPI cannot see the body models; `document` puts them back into the generated schema,
together with the OpenAI error body each route may answer with. One source of truth: the same models parse the
requests.
"""

from __future__ import annotations

import warnings
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .errors import ERROR_TYPES

_REF = "#/components/schemas/{model}"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """What every error answers with: OpenAI's `{"error": {...}}`."""

    error: ErrorBody


_WHY = {
    400: "invalid request: bad JSON, a field out of range, an unsupported parameter, a prompt over the context",
    404: "unknown model, file, batch or route",
    405: "method not allowed (the Allow header lists the allowed ones)",
    409: "the batch has ended: there is nothing to cancel",
    413: "request body over the gateway's limit",
    429: "too many requests in flight (Retry-After)",
    500: "internal error",
    503: "no scheduler or no live workers (Retry-After)",
    504: "the request did not finish within its deadline",
}
GENERATION_ERRORS = (400, 404, 413, 429, 500, 503, 504)
SIMPLE_ERRORS = (400, 404, 413, 500)


def _error_responses(statuses: tuple[int, ...]) -> dict[str, Any]:
    ref = {"$ref": _REF.format(model="ErrorResponse")}
    return {
        str(s): {
            "description": f"{ERROR_TYPES.get(s, 'Error')}: {_WHY[s]}",
            "content": {"application/json": {"schema": ref}},
        }
        for s in statuses
    }


def document(app: FastAPI, bodies: dict[str, type[BaseModel]], errors: dict[str, tuple[int, ...]]) -> None:
    """Replace `app.openapi` with one that names `bodies[path]` as the JSON request body of each POST `path` and
    `errors[path]` as its error responses (every other route: 404 / 405 / 500)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        with warnings.catch_warnings():  # GET + HEAD routes share an operation id; each gets its own below
            warnings.simplefilter("ignore", UserWarning)
            spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        schemas: dict[str, Any] = spec.setdefault("components", {}).setdefault("schemas", {})
        for model in (*bodies.values(), ErrorResponse):
            schema = model.model_json_schema(ref_template=_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        for path, ops in spec["paths"].items():
            for method, op in ops.items():
                op["operationId"] = f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}"
                responses = op.setdefault("responses", {})
                responses.pop("422", None)  # FastAPI's validation error: never answered here
                if method == "post" and path in bodies:
                    ref = {"$ref": _REF.format(model=bodies[path].__name__)}
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
                responses.update(_error_responses(errors.get(path, (404, 405, 500))))
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
