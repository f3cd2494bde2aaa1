"""One process of `spindle verify --kvp-prefill N [--spp S]` (started by it, not by hand).

Member m of the N KV-parallel members is ranks [m x S, (m + 1) x S): one process holding the whole model (S = 1), or
a sequence pipeline of S stages (Medha's 3D) whose first rank leads. The prompt's chunks go to the members in turn,
a consecutive share each, the group growing as the prompt spills onto the next member (Medha's KV parallelism);
then the last member masters every greedy decode step while all of them attend its queries over their shares.
Each leader writes the logits rows it computed (the first token's, every decode step's) with their output indices,
its tokens and the blocks it still holds; a later stage writes its step count.
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
    spp: int = 1  # pipeline stages of each member (Medha's 3D when > 1)

    @property
    def world(self) -> int:
        return self.members * self.spp

    def leaders(self) -> list[int]:
        return [m * self.spp for m in range(self.members)]

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


def _leader_engine(spec: KVPVerifySpec, rank: int, kept: list[torch.Tensor]) -> Engine:
    """This member's engine; every logits row it computes is appended to `kept`."""
    if spec.spp == 1:
        engine = Engine(spec.engine_config())
        compute_logits = engine.model.compute_logits

        def keep_logits(hidden: torch.Tensor) -> torch.Tensor:
            out = compute_logits(hidden)
            kept.append(out.detach().float().clone())
            return out

        engine.model.compute_logits = keep_logits  # type: ignore[method-assign]
        return engine
    from spindle_model import resolve_model

    from ..spp.leader import SPPLeaderEngine, load_stage, spp_engine_config
    from ..spp.stage import PipelineLayout

    layout = PipelineLayout.consecutive(rank, spec.spp, 1)
    config = spp_engine_config(spec.engine_config(), resolve_model(spec.model).config, spec.spp)
    model, head = load_stage(config, spec.spp, 0)
    assert head is not None
    engine = SPPLeaderEngine(config, model, head, layout, keepalive_s=3600.0)
    engine.runner.kept_logits = kept
    return engine


def run_member(spec: KVPVerifySpec, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    kept: list[torch.Tensor] = []
    engine = _leader_engine(spec, rank, kept)
    me = rank // spec.spp
    leaders = spec.leaders()
    params = SamplingParams(max_tokens=spec.max_new_tokens, temperature=0.0, ignore_eos=True)
    indices: list[int] = []
    tokens: list[int] = []

    def iteration(batch: int, members: list[int], chunks: list[ChunkWork], decodes: list[DecodeWork]) -> None:
        res = run_iteration(
            engine, me, members, [], decodes, chunks=chunks, aborted=set(), spec_of=lambda rid: rid.encode(),
            params_of=lambda _: params, batch_id=batch, timeout_s=600.0,
        )  # fmt: skip
        for o in res.outputs:
            indices.append(o.index)
            tokens.append(o.token)

    batch = 0
    for start, end, master in spec.chunks():
        if me <= master:  # the group grows as the prompt spills onto the next member
            if start == 0 and me == master:
                engine.add_directed(REQUEST, spec.token_ids, params)
            iteration(batch, leaders[: master + 1], [ChunkWork(REQUEST, master, start, end)], [])
        batch += 1
    for _ in range(spec.max_new_tokens - 1):  # the last one ends the request on every member
        iteration(batch, leaders, [], [DecodeWork(REQUEST, spec.members - 1)])
        batch += 1
    report = {"rank": rank, "member": me, "stage": 0, "blocks_leaked": engine.allocator.num_used,
              "directed_left": len(engine.directed)}  # fmt: skip
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    logits = torch.cat(kept) if kept else torch.empty(0)
    return {"logits": logits, "index": torch.tensor(indices, dtype=torch.int64),
            "tokens": torch.tensor(tokens, dtype=torch.int64)}, report  # fmt: skip


def run_stage(spec: KVPVerifySpec, rank: int) -> dict:
    from spindle_model import resolve_model

    from ..spp.leader import load_stage, spp_engine_config
    from ..spp.stage import PipelineLayout, PipelineStage

    leader, stage = rank - rank % spec.spp, rank % spec.spp
    layout = PipelineLayout.consecutive(leader, spec.spp, 1)
    config = spp_engine_config(spec.engine_config(), resolve_model(spec.model).config, spec.spp)
    model, _ = load_stage(config, spec.spp, stage)
    assert config.kv_cache_tokens is not None
    pipeline = PipelineStage(model, layout, rank, num_blocks=config.kv_cache_tokens // BLOCK_SIZE,
                             block_size=BLOCK_SIZE)  # fmt: skip
    pipeline.serve()
    return {"rank": rank, "member": rank // spec.spp, "stage": stage, "steps": pipeline.stats.steps,
            "blocks_leaked": 0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "spindle verify --kvp-prefill", "a KVPVerifySpec as JSON")
    spec = KVPVerifySpec(**json.loads(args.spec.read_text()))
    join_gloo(args, spec.threads)
    try:
        if args.rank % spec.spp == 0:
            tensors, report = run_member(spec, args.rank)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / f"rank{args.rank}.safetensors"))
        else:
            report = run_stage(spec, args.rank)
        (args.out / f"rank{args.rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
