"""The gateway's HTTP routes: OpenAI-compatible completions (stream and not), models, (de)tokenize, health,
metrics, the live dashboard (dashboard.py). Every GET route answers HEAD too; every request body passes the size
limit (body_limit.py) first."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from spindle_protocol.messages import ServiceClass

from . import dashboard, openapi, tokenize_api, tracing
from .batch import routes as batch_routes
from .batch.runner import BatchRunner
from .body_limit import BodySizeLimit
from .errors import GatewayError, install_error_handlers
from .inputs import Kind, prepare_chat, prepare_completion
from .metrics import CONTENT_TYPE
from .request_flow import Disconnected, Generation
from .schemas import ChatCompletionRequest, CompletionRequest, parse_body
from .sse import DONE, ChoiceOutput, ResponseBuilder, error_event
from .state import GatewayState

_encode = msgspec.json.Encoder().encode


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json")


class GenerationStream(StreamingResponse):
    """SSE response that aborts its request however the response ends (finished, disconnect, cancellation)."""

    def __init__(self, body: AsyncIterator[bytes], generation: Generation) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close("client disconnected")  # no-op when the request already ended


def create_app(state: GatewayState) -> FastAPI:
    app = FastAPI(title="Spindle gateway", version="0.1.0", summary="OpenAI-compatible API of a Spindle cluster")
    app.state.gateway = state
    install_error_handlers(app, on_error=state.metrics.error)
    files_limit = {"/v1/files": state.config.batch_max_file_bytes + (1 << 20)}  # + room for the form's headers
    app.add_middleware(BodySizeLimit, limit=state.config.body_limit, on_reject=state.metrics.error, paths=files_limit)
    served = state.config.served_model_name

    def check_model(model: str | None) -> None:
        if model is not None and model not in (served, state.config.model):
            raise GatewayError(404, f"The model `{model}` does not exist.", param="model")

    async def start(
        kind: Kind, body: bytes, headers: Any, service_class: ServiceClass = "interactive"
    ) -> tuple[Generation, ResponseBuilder]:
        """Parse, admit and start one generation (GatewayError when any of it fails: the request has ended)."""
        arrival = time.time()
        limits = state.limits()
        if kind == "chat":
            chat = parse_body(body, ChatCompletionRequest)
            check_model(chat.model)
            params = await prepare_chat(chat, state.tokenizer, limits)
        else:
            completion = parse_body(body, CompletionRequest)
            check_model(completion.model)
            params = await prepare_completion(completion, state.tokenizer, limits)
        if params.stream and service_class == "batch":
            raise GatewayError(400, "stream is not supported in a batch", param="stream")
        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        root = state.tracer.start_span(
            "gateway.request",
            context=tracing.extract(headers),
            start_time=int(arrival * 1e9),
            attributes={
                "spindle.request_id": request_id,
                "spindle.endpoint": kind,
                "spindle.stream": params.stream,
                "spindle.prompt_tokens": len(params.prompt_ids),
                "spindle.max_tokens": params.sampling.max_tokens,
                "spindle.service_class": service_class,
            },
        )
        generation = Generation(state, request_id, params, arrival, root, service_class)
        await generation.start()  # GatewayError (429, 503, ...) -> error JSON; the request has ended
        builder = ResponseBuilder(
            kind,
            request_id,
            served,
            int(arrival),
            params.include_usage,
            token_text=state.token_text,
            echo=params.echo,
            tool_call=params.tool_call,
        )
        return generation, builder

    async def generate(request: Request, kind: Kind) -> Response:
        generation, builder = await start(kind, await request.body(), request.headers)
        if generation.params.stream:
            return GenerationStream(sse_body(generation, builder, request), generation)
        response = await collect(generation, builder, request.is_disconnected)
        return Response(status_code=499) if response is None else _json(response)  # 499: nobody reads it

    async def run_line(kind: Kind, body: bytes) -> tuple[int, dict[str, Any]]:
        """One line of a batch: a non-streaming request of the throughput class; (HTTP status, response JSON)."""
        try:
            generation, builder = await start(kind, body, {}, "batch")
            response = await collect(generation, builder, None)
        except GatewayError as e:
            state.metrics.error(e.status)
            return e.status, e.body()
        assert response is not None, "a batch line has no client to go away"
        return 200, response

    async def collect(
        generation: Generation, builder: ResponseBuilder, is_disconnected: Disconnected | None
    ) -> dict[str, Any] | None:
        """The whole response, or None when the client went away."""
        want_logprobs = generation.params.sampling.logprobs is not None
        choices = [ChoiceOutput(logprobs=[] if want_logprobs else None) for _ in range(generation.params.sampling.n)]
        async for delta in generation.deltas(is_disconnected):
            if delta.error is not None:
                raise delta.error
            choice = choices[delta.index]
            choice.text += delta.text
            if choice.logprobs is not None and delta.logprobs:
                choice.logprobs += delta.logprobs
            if delta.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.last:
                assert delta.usage is not None
                builder.set_prompt(generation.params.prompt_ids, generation.prompt_logprobs)
                return builder.response(choices, delta.usage)
        return None

    async def sse_body(generation: Generation, builder: ResponseBuilder, request: Request) -> AsyncIterator[bytes]:
        role_sent: set[int] = set() if builder.kind == "chat" else set(range(generation.params.sampling.n))
        calls: dict[int, str] = {}  # tool-call text per choice, until it finishes
        if builder.echo:
            for i in range(generation.params.sampling.n):
                yield builder.echo_chunk(i)
        async for delta in generation.deltas(request.is_disconnected):
            if delta.error is not None:
                state.metrics.error(delta.error.status)
                yield error_event(delta.error.body())
                break
            i = delta.index
            prompt_lps = None
            if builder.prompt is None and generation.prompt_logprobs is not None:
                builder.set_prompt(generation.params.prompt_ids, generation.prompt_logprobs)
                prompt_lps = builder.prompt_logprobs()
            if i not in role_sent and (delta.new_tokens or delta.finish_reason is not None):
                role_sent.add(i)
                yield builder.role_chunk(i)
            if builder.tool_call:  # the call goes out whole when its choice finishes
                calls[i] = calls.get(i, "") + delta.text
                if delta.finish_reason is not None:
                    yield builder.tool_call_chunk(calls[i], delta.finish_reason, i)
            elif delta.finish_reason is not None:
                yield builder.delta_chunk(
                    delta.text, delta.finish_reason, delta.stop_reason, delta.logprobs, i, prompt_logprobs=prompt_lps
                )
            elif delta.text or delta.logprobs or prompt_lps:
                yield builder.delta_chunk(delta.text, logprobs=delta.logprobs, index=i, prompt_logprobs=prompt_lps)
            if delta.last and builder.include_usage:
                assert delta.usage is not None
                yield builder.usage_chunk(delta.usage)
        if generation.terminal != "aborted":
            yield DONE

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    def model_card() -> dict[str, Any]:
        return {
            "id": served,
            "object": "model",
            "created": state.created,
            "owned_by": "spindle",
            "root": state.config.model,
            "parent": None,
            "max_model_len": state.max_model_len,
        }

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> Response:
        return _json({"object": "list", "data": [model_card()]})

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str) -> Response:
        check_model(model_id)
        return _json(model_card())

    async def tokenize(request: Request) -> Response:
        req = tokenize_api.parse_tokenize(await request.body())
        check_model(req.model)
        return _json(await tokenize_api.tokenize(req, state.tokenizer, state.max_model_len))

    async def detokenize(request: Request) -> Response:
        req = parse_body(await request.body(), tokenize_api.DetokenizeRequest)
        check_model(req.model)
        return _json(await tokenize_api.detokenize(req, state.tokenizer, state.config.vocab_size))

    for prefix in ("", "/v1"):
        app.add_api_route(prefix + "/tokenize", tokenize, methods=["POST"])
        app.add_api_route(prefix + "/detokenize", detokenize, methods=["POST"])

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        ok, reason = await state.cluster.health()
        state.metrics.update_cluster(None if state.cluster.error else state.cluster.cached)
        if not ok:  # answered directly: health polls are not request errors in the metrics
            return GatewayError(503, f"unhealthy: {reason}").response()
        if reason != "ok":  # still serving, with less capacity: what is missing
            cached = state.cluster.cached
            return _json({"status": "degraded", "missing": cached.dead_instances if cached else []})
        return _json({"status": "ok"})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        state.metrics.update_cluster(await state.cluster.status())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/v1/spindle/instances", methods=["GET", "HEAD"])
    async def instances() -> Response:
        """Exact per-instance state (blocks held per request), asked of every live instance."""
        try:
            stats = await state.cluster.instance_stats()
        except ConnectionError as e:
            return GatewayError(503, str(e)).response()
        return _json({"instances": stats})

    if state.dashboard is not None:
        dashboard.install(app, state.dashboard)

    if state.batches is not None:
        state.batch_runner = BatchRunner(state.batches, run_line, state.config.batch_concurrency)
        batch_routes.install(app, state.batch_runner, state.config.batch_max_file_bytes, state.config.batch_max_lines)

    bodies: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatCompletionRequest}
    bodies["/v1/completions"] = CompletionRequest
    errors = dict.fromkeys(bodies, openapi.GENERATION_ERRORS)
    for prefix in ("", "/v1"):
        bodies[prefix + "/tokenize"] = tokenize_api.TokenizeRequest
        bodies[prefix + "/detokenize"] = tokenize_api.DetokenizeRequest
        errors[prefix + "/tokenize"] = errors[prefix + "/detokenize"] = openapi.SIMPLE_ERRORS
    errors |= {"/v1/models/{model_id}": (404, 500), "/health": (500, 503), "/v1/spindle/instances": (500, 503)}
    errors |= {dashboard.TIMELINE: (400, 500), dashboard.PAGE: (500,)}
    if state.batches is not None:
        bodies["/v1/batches"] = batch_routes.CreateBatch
        errors |= dict.fromkeys(batch_routes.PATHS, (400, 404, 409, 413, 500))
    openapi.document(app, bodies, errors)
    return app
