"""Seesaw (seed 004): throughput-oriented serving that re-shards one group of GPUs between a prefill and a decode
parallel configuration. `configs.py` chooses the two from the cost model; the strategy itself is not registered
yet (issue 25)."""
