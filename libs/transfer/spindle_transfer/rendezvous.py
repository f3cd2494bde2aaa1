"""The data plane's rendezvous: a torch `TCPStore` that processes meet at (`mesh://host:port`).

It holds the mesh's join log and the keys gloo exchanges while a pair of processes forms its group; it carries
no tensor. `spindle up` runs it as its own small process, so any instance can die and come back around it:

    python -m spindle_transfer.rendezvous --port 29500 [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from .store import JOINS, serve_store

log = logging.getLogger("spindle.rendezvous")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spindle_transfer.rendezvous",
        description="Host the data plane's rendezvous store until SIGTERM: processes started with "
        "--dist-init mesh://HOST:PORT meet here and form a gloo group per pair (any of them may restart).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    p.add_argument("--log-level", default="INFO", help="log level (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        store = serve_store(args.host, args.port)
    except OSError as e:
        p.exit(1, f"cannot listen on {args.host}:{args.port}: {e.strerror or e}\n")
    store.set(JOINS, "")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("rendezvous store ready at mesh://%s:%d", args.host, args.port)
    stop.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
