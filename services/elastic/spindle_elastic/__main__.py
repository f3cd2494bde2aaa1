"""`python -m spindle_elastic`: an elastic (colocated) instance."""

from __future__ import annotations

import argparse

from spindle_protocol import service
from spindle_worker import InstanceConfig

from .instance import ElasticInstance


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spindle_elastic",
        description="Spindle elastic (colocated) instance: prefills the prompts the scheduler plans onto it and "
        "decodes them in the same engine, prompt chunks mixed into the running decode batch under one per-step "
        "token budget (--max-num-batched-tokens: the chunk size); streams every token to the gateway. No KV "
        "moves. What a machine with few cores wants (`spindle up --elastic N`, the `chunked` strategy).",
    )
    service.add_worker_args(p, "elastic")
    service.add_engine_args(p)
    service.add_common_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    service.setup_logging(args.log_level, "elastic")
    config = InstanceConfig.from_args("elastic", args)
    service.run(ElasticInstance(config).run, args.parent_pid)


if __name__ == "__main__":
    main()
