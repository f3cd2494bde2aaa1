"""One process of `spindle verify --kvp-prefill N` (started by it, not by hand): member `rank` of the group.

Every member holds the whole model. The prompt's chunks go to the members in turn, each taking a consecutive share
(the group growing as the prompt spills onto the next member: Medha's KV parallelism), then the last member masters every greedy decode step while all of them
attend its queries over their shares. Each member writes the logits rows it computed (the first token's, every
decode step's) with their output indices, its tokens and the blocks it still holds.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..config import EngineConfig
from ..engine import Engine
from ..sampling_params import SamplingParams
from ..sp.verify_worker import join_gloo, worker_args
from .iteration import ChunkWork, DecodeWork, run_iteration

BLOCK_SIZE = 16
REQUEST = "verify"


@dataclass(frozen=True)
class KVPVerifySpec:
    model: str
    dtype: str
    token_ids: list[int]
    members: int
    chunk: int
    max_new_tokens: int = 8
    threads: int = 1

    def chunks(self) -> list[tuple[int, int, int]]:
        """(start, end, master) of every prompt chunk: the chunks in consecutive shares as even as they go, one per
        member in order."""
        n = len(self.token_ids)
        bounds = [*range(0, n, self.chunk), n]
        count = len(bounds) - 1
        return [(bounds[i], bounds[i + 1], i * self.members // count) for i in range(count)]

    def engine_config(self) -> EngineConfig:
        room = len(self.token_ids) + self.max_new_tokens + BLOCK_SIZE
        return EngineConfig(
            model=self.model, dtype=self.dtype, block_size=BLOCK_SIZE, kv_cache_tokens=room + BLOCK_SIZE,
            max_model_len=room,
        )  # fmt: skip


def run_member(spec: KVPVerifySpec, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    engine = Engine(spec.engine_config())
    kept: list[torch.Tensor] = []
    compute_logits = engine.model.compute_logits

    def keep_logits(hidden: torch.Tensor) -> torch.Tensor:
        out = compute_logits(hidden)
        kept.append(out.detach().float().clone())
        return out

    engine.model.compute_logits = keep_logits  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=spec.max_new_tokens, temperature=0.0, ignore_eos=True)
    everyone = list(range(spec.members))
    indices: list[int] = []
    tokens: list[int] = []

    def iteration(batch: int, members: list[int], chunks: list[ChunkWork], decodes: list[DecodeWork]) -> None:
        res = run_iteration(
            engine, members.index(rank), members, [], decodes, chunks=chunks, aborted=set(),
            spec_of=lambda rid: rid.encode(), params_of=lambda _: params, batch_id=batch, timeout_s=600.0,
        )  # fmt: skip
        for o in res.outputs:
            indices.append(o.index)
            tokens.append(o.token)

    batch = 0
    for start, end, master in spec.chunks():
        if rank <= master:  # the group grows as the prompt spills onto the next member
            if start == 0 and rank == master:
                engine.add_directed(REQUEST, spec.token_ids, params)
            iteration(batch, everyone[: master + 1], [ChunkWork(REQUEST, master, start, end)], [])
        batch += 1
    last = spec.members - 1
    for _ in range(spec.max_new_tokens - 1):  # the last one ends the request on every member
        iteration(batch, everyone, [], [DecodeWork(REQUEST, last)])
        batch += 1
    held = engine.directed.get(REQUEST)
    report = {"rank": rank, "blocks_leaked": engine.allocator.num_used, "directed_left": len(engine.directed),
              "entries": 0 if held is None else int(held.num_computed_tokens)}  # fmt: skip
    logits = torch.cat(kept) if kept else torch.empty(0)
    return {"logits": logits, "index": torch.tensor(indices, dtype=torch.int64),
            "tokens": torch.tensor(tokens, dtype=torch.int64)}, report  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "spindle verify --kvp-prefill", "a KVPVerifySpec as JSON")
    spec = KVPVerifySpec(**json.loads(args.spec.read_text()))
    join_gloo(args, spec.threads)
    try:
        tensors, report = run_member(spec, args.rank)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / f"rank{args.rank}.safetensors"))
        (args.out / f"rank{args.rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
