"""Prefill chunk times on real sequence-parallel groups (`spindle profile --sp-sizes 2,4`).

For each SP size S, S spawned processes (one torch thread each, one gloo group on loopback) run the same
(history C, chunk L) grid as the SP 1 measurement, through `spindle_engine.sp.SPPrefill`: per history, one
plan whose chunks are C then each L in turn, all on the same S members (zigzag). Every chunk starts after a
barrier and its time is the slowest member's, so a sample is what the group takes once all members are
free, which is what Tetris's Eq. 1 predicts per SP size. On a machine with fewer cores than S, the numbers
include the members' contention for cores: they describe this machine, not a cluster.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from .ranks import run_ranks

MEMBER_THREADS = 1  # torch threads per SP member: S members share this machine's cores


def _sp_rank(rank: int, world: int, port: int, out_dir: str, spec: dict) -> None:
    """One member (module level, so spawned processes can import it)."""
    import torch
    import torch.distributed as dist

    from spindle_engine.config import DTYPES
    from spindle_engine.kv_cache import BlockAllocator, KVCache
    from spindle_engine.sp import SPChunk, SPPlan, SPPrefill
    from spindle_model import LlamaModel, load_state_dict, resolve_model

    torch.set_num_threads(MEMBER_THREADS)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        source = resolve_model(spec["model"], progress=False)
        dtype = DTYPES[spec["dtype"]]
        model = LlamaModel(source.config, dtype=dtype)
        model.load_weights(load_state_dict(source.path, dtype=dtype))
        histories, chunks = spec["histories"], spec["chunks"]
        cfg, bs = source.config, 16
        blocks = -(-(max(histories) + sum(chunks)) // bs) + 1
        cache = KVCache(cfg.num_layers, blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype)
        allocator = BlockAllocator(blocks, bs)
        members = tuple(range(world))
        gen = torch.Generator().manual_seed(spec["seed"])  # same draws on every rank: same prompt
        raw: dict[tuple[int, int, int], list[float]] = {}

        def run(hist: int, rid: str, record: bool) -> None:
            lengths = ([hist] if hist else []) + list(chunks)
            bounds, start = [], 0
            for n in lengths:
                bounds.append(SPChunk(start, start + n, members, "zigzag"))
                start += n
            ids = torch.randint(3, cfg.vocab_size, (start,), generator=gen).tolist()
            sp = SPPrefill(model, cache, allocator, rid, ids, SPPlan(tuple(bounds)), rank, dict(enumerate(members)))
            for k, c in enumerate(bounds):
                dist.barrier()
                t0 = time.perf_counter()
                sp.run_chunk_or_release(k)
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if record:
                    raw.setdefault((world, c.start, c.num_tokens), []).append(float(took))
            sp.release()

        for i in range(spec["warmup"]):
            run(0, f"warmup-{i}", False)
        for rep in range(spec["repeats"]):
            for hist in histories:
                run(hist, f"profile-{rep}-{hist}", True)
        if rank == 0:
            rows = [[*key, statistics.median(t)] for key, t in sorted(raw.items())]
            (Path(out_dir) / "sp.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure_sp_prefill(spec: dict, sp: int, timeout_s: float = 900.0) -> list[list[float]]:
    """[[sp, C, L, median seconds], ...] on `sp` spawned members. `spec`: model, dtype, histories, chunks,
    repeats, warmup, seed."""
    from spindle_transfer.testing import free_port

    if sp < 2:
        raise ValueError(f"SP sizes measured here must be >= 2, got {sp}")
    with tempfile.TemporaryDirectory() as d:
        run_ranks(_sp_rank, sp, (sp, free_port(), d, spec), timeout_s, f"the SP={sp} prefill measurement")
        return json.loads((Path(d) / "sp.json").read_text())
