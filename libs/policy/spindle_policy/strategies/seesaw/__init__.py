"""Seesaw (seed 004): throughput-oriented serving that re-shards one group of GPUs between a prefill and a decode
parallel configuration, with a host-memory KV tier between the phases. `configs.py` chooses the two from the cost
model; `strategy.py` schedules (registered as `seesaw`)."""

from . import strategy  # noqa: F401
