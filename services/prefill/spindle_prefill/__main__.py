"""`python -m spindle_prefill`: a prefill instance."""

from __future__ import annotations

import argparse

from spindle_protocol import service
from spindle_worker import InstanceConfig
from spindle_worker.device import add_device_args

from .instance import PrefillInstance


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spindle_prefill",
        description="Spindle prefill instance: runs prompts planned onto it by the scheduler (chunked prefill), "
        "streams each request's first token and hands its KV to the chosen decode instance over the data plane.",
    )
    service.add_worker_args(p, "prefill")
    service.add_engine_args(p)
    add_device_args(p)
    service.add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    service.setup_logging(args.log_level, "prefill")
    try:
        config = InstanceConfig.from_args("prefill", args)
    except ValueError as e:
        parser.error(str(e))
    service.run(PrefillInstance(config).run, args.parent_pid)


if __name__ == "__main__":
    main()
