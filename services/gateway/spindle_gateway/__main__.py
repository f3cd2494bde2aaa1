"""`python -m spindle_gateway`: the OpenAI-compatible HTTP front of a Spindle cluster.

It loads only the tokenizer (spindle_tokenizer: no torch), connects to NATS and serves HTTP with uvicorn.
SIGTERM/SIGINT (or the death of `--parent-pid`) stop it: streams in flight get a terminal error event, their
requests are aborted everywhere. With SPINDLE_STACK_TOKEN set (`spindle up` sets it), /health answers carry it in
the `x-spindle-stack` header.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from spindle_protocol.service import add_common_args, run, setup_logging

# The app, the tokenizer and uvicorn are imported in serve(), so that --help answers at once.

log = logging.getLogger("spindle.gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spindle_gateway",
        description="Spindle gateway: OpenAI-compatible /v1/chat/completions and /v1/completions (stream and "
        "non-stream), /v1/models, /health and /metrics in front of the scheduler and workers on NATS.",
    )
    add_common_args(parser)
    g = parser.add_argument_group("gateway")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s)")
    g.add_argument(
        "--model", default="smollm2", help="model name or path; only its tokenizer is loaded (default %(default)s)"
    )
    g.add_argument("--served-model-name", default=None, help="the `model` clients use (default: --model)")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's context; a smaller limit reported "
        "by the scheduler wins)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds from arrival until a request is ended with a 504 (default %(default)s)",
    )
    g.add_argument(
        "--max-stop-strings", type=int, default=32, help="most stop strings per request (default %(default)s)"
    )
    g.add_argument(
        "--admit-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for the scheduler's admission reply before answering 503 (default %(default)s)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="larger request bodies are answered 413 before they are read (default: 16 bytes per token of "
        "--max-model-len, at least 4 MiB: room for a prompt that fills the context)",
    )
    g.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a chat request that sends none (default: the model's generation_config max_new_tokens, "
        "else all the room the context leaves, as vLLM; completions default to 16 as OpenAI's)",
    )
    g.add_argument(
        "--no-dashboard",
        action="store_true",
        help="serve no /dashboard (the cluster live) and /v1/spindle/timeline: the gateway then does not follow the "
        "workers' events, heartbeats and the scheduler's decisions",
    )
    b = parser.add_argument_group("batch API (/v1/files, /v1/batches)")
    b.add_argument(
        "--batch-db",
        default=None,
        help="SQLite file holding uploaded files, batches and their results, kept across restarts: a gateway "
        "started on the same file resumes the batches it left (default: $XDG_STATE_HOME or ~/.local/state, then "
        "spindle/gateway-<port>/batches.sqlite; 'off': no Batch API)",
    )
    b.add_argument(
        "--batch-max-file-bytes", type=int, default=200 << 20, help="largest upload to /v1/files (default 200 MiB)"
    )
    b.add_argument("--batch-max-lines", type=int, default=50_000, help="requests per batch (default %(default)s)")
    b.add_argument(
        "--batch-concurrency",
        type=int,
        default=16,
        help="batch requests in flight at once over all batches; the scheduler treats them as throughput-class "
        "(default %(default)s)",
    )
    return parser


def default_batch_db(port: int) -> str:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "spindle", f"gateway-{port}", "batches.sqlite")


def _server(app: Any, args: argparse.Namespace) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # spindle_protocol.service.run owns SIGINT/SIGTERM; they set `stop`

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        lifespan="off",
        log_config=None,
        access_log=args.log_level.upper() == "DEBUG",
        timeout_graceful_shutdown=5,
    )
    return Server(config)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from spindle_protocol.bus import Bus
    from spindle_protocol.service import STACK_TOKEN_ENV

    from . import tracing
    from .app import create_app
    from .config import GatewayConfig
    from .model_files import load_model_files
    from .stack_token import with_stack_token
    from .state import GatewayState

    tracing.setup("spindle-gateway", args.otlp_endpoint)
    model = await asyncio.to_thread(load_model_files, args.model)
    tokenizer = model.tokenizer
    config = GatewayConfig(
        served_model_name=args.served_model_name or args.model,
        model=args.model,
        max_model_len=args.max_model_len or model.max_position_embeddings,
        vocab_size=model.vocab_size,
        request_timeout=args.request_timeout,
        max_stop_strings=args.max_stop_strings,
        admit_timeout=args.admit_timeout,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        batch_db=None if args.batch_db == "off" else args.batch_db or default_batch_db(args.port),
        batch_max_file_bytes=args.batch_max_file_bytes,
        batch_max_lines=args.batch_max_lines,
        batch_concurrency=args.batch_concurrency,
        dashboard=not args.no_dashboard,
    )
    states: list[GatewayState] = []

    async def on_disconnect() -> None:
        if states:
            states[0].bus_lost()

    async def on_reconnect() -> None:
        if states:
            states[0].bus_back()

    bus = await Bus.connect(
        args.nats_url,
        "spindle-gateway",
        inject=tracing.inject_hook(),
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    state = GatewayState(config, tokenizer, bus)
    states.append(state)
    if state.dashboard is not None:
        await state.dashboard.start()
    server = _server(with_stack_token(create_app(state), os.environ.get(STACK_TOKEN_ENV)), args)
    if state.batch_runner is not None:
        log.info("batch API on %s", config.batch_db)
        state.batch_runner.resume()
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await state.drain()
        await serving
    finally:
        stopping.cancel()
        await bus.close()
        tracing.shutdown()
        log.info("gateway stopped")


def cli() -> None:
    args = build_parser().parse_args()
    setup_logging(args.log_level, "gateway")
    run(lambda stop: serve(args, stop), args.parent_pid)


if __name__ == "__main__":
    cli()
