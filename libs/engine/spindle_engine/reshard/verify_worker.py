"""One process of `spindle verify --reshard` (started by it, not by hand): for each round, load this rank's shard
of the prefill configuration from the shared host weights, run the prompt through the pipeline pushing its KV to
the host tier, re-shard to the decode configuration, pull its KV heads and decode greedily. Rank 0 writes the
tokens and logits; every rank writes its times and bytes."""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from spindle_model import resolve_model

from ..config import DTYPES
from ..sp.verify_worker import join_gloo, worker_args
from .config import ReshardPlan
from .host_kv import HostKV
from .host_weights import HostWeights
from .phases import SwapIn, SwapOut, decode, load, prefill


@dataclass(frozen=True)
class ReshardSpec:
    model: str
    dtype: str
    token_ids: list[int]
    plan: str  # PPa[xTPb]:TPc
    weights: str  # the published host weights (HostWeights)
    kv: str  # the host KV tier's file (HostKV)
    max_new_tokens: int = 8
    rounds: int = 2  # prefill -> decode -> back to the prefill configuration -> ...
    threads: int = 1


def run(spec: ReshardSpec, rank: int, out: Path) -> None:
    plan = ReshardPlan.parse(spec.plan)
    config = resolve_model(spec.model).config
    dtype = DTYPES[spec.dtype]
    weights = HostWeights(Path(spec.weights))
    n = len(spec.token_ids)
    store = HostKV(Path(spec.kv), config.num_layers, config.num_kv_heads, n, config.head_dim, dtype, create=False)
    report: dict = {"rank": rank, "rounds": []}
    tensors: dict[str, torch.Tensor] = {}
    for r in range(spec.rounds):
        row: dict = {}
        loaded = load(config, dtype, plan.prefill, rank, weights)
        row["prefill_load_s"], row["prefill_weight_bytes"] = loaded.seconds, loaded.bytes
        swap_out = SwapOut(store, loaded.model.shard.kv_heads)
        dist.barrier()  # the whole group is in the prefill configuration
        t0 = time.perf_counter()
        logits = prefill(loaded.model, plan.prefill, rank, spec.token_ids, swap_out)
        swap_out.drain()
        row["prefill_s"] = time.perf_counter() - t0
        row["swap_out_s"], row["swap_out_exposed_s"] = swap_out.busy_s, swap_out.exposed_s
        row["layers"] = list(loaded.model.layer_range)
        del loaded
        gc.collect()
        dist.barrier()  # every layer's KV is in the host tier before anyone reads it

        loaded = load(config, dtype, plan.decode, rank, weights)
        row["decode_load_s"], row["decode_weight_bytes"] = loaded.seconds, loaded.bytes
        t0 = time.perf_counter()
        swap_in = SwapIn(store, loaded.model, n, n + spec.max_new_tokens)
        tokens, decode_logits = decode(loaded.model, swap_in, n, int(logits.argmax()), spec.max_new_tokens - 1)
        swap_in.join()
        row["decode_s"] = time.perf_counter() - t0
        row["swap_in_s"], row["swap_in_exposed_s"] = swap_in.busy_s, swap_in.exposed_s
        del loaded, swap_in
        gc.collect()
        tensors[f"tokens{r}"] = torch.tensor(tokens)
        tensors[f"logits{r}"] = torch.cat([logits[None], decode_logits])  # [max_new_tokens, vocab]
        report["rounds"].append(row)
        dist.barrier()  # the next round overwrites the host tier
    report["kv_pushed"], report["kv_pulled"] = store.pushed, store.pulled
    if rank == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "rank0.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "spindle verify --reshard", "a ReshardSpec as JSON")
    spec = ReshardSpec(**json.loads(args.spec.read_text()))
    join_gloo(args, spec.threads)
    try:
        run(spec, args.rank, args.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
