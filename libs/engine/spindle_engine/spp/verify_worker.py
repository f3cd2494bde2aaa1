"""One process of `spindle verify --spp N` (started by it, not by hand): stage `rank` of the pipeline.

Rank 0 leads: it runs the prompt through an `SPPLeaderEngine` in chunks of `chunk` tokens, decodes greedily and
writes the tokens, every sampled row's logits (the last prompt token's, then each decode step's) and its timings;
the other ranks serve their stage and write theirs.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..config import EngineConfig
from ..sampling_params import SamplingParams
from ..sp.verify_worker import join_gloo, worker_args
from .leader import SPPLeaderEngine, load_stage, spp_engine_config
from .stage import PipelineLayout, PipelineStage

BLOCK_SIZE = 16


@dataclass(frozen=True)
class SPPVerifySpec:
    model: str
    dtype: str
    token_ids: list[int]
    spp: int
    chunk: int
    max_new_tokens: int = 8
    threads: int = 1
    pipelined: bool = True  # False: the leader waits for every step (no sequence pipelining), for comparison
    tp: int = 1  # tensor-parallel ranks inside each stage

    @property
    def layout(self) -> PipelineLayout:
        return PipelineLayout.consecutive(0, self.spp, self.tp)

    def engine_config(self) -> EngineConfig:
        room = len(self.token_ids) + self.max_new_tokens + BLOCK_SIZE
        return EngineConfig(
            model=self.model, dtype=self.dtype, block_size=BLOCK_SIZE, kv_cache_tokens=room + BLOCK_SIZE,
            max_model_len=room, max_num_batched_tokens=self.chunk, long_prefill_token_threshold=self.chunk,
        )  # fmt: skip


def run_leader(spec: SPPVerifySpec) -> tuple[dict[str, torch.Tensor], dict]:
    layout = spec.layout
    config = spp_engine_config(spec.engine_config(), _model_config(spec), spec.spp, spec.tp)
    model, head = load_stage(config, spec.spp, 0, layout.stages[0])
    assert head is not None
    engine = SPPLeaderEngine(config, model, head, layout, keepalive_s=3600.0)
    runner = engine.runner
    runner.record_spans = True
    runner.pipelined = spec.pipelined
    logits: list[torch.Tensor] = []
    runner.kept_logits = logits
    params = SamplingParams(max_tokens=spec.max_new_tokens, temperature=0.0, ignore_eos=True)
    dist.barrier()  # every stage has loaded its layers: time the request alone
    t0 = time.time()
    engine.add_request("verify", spec.token_ids, params)
    tokens: list[int] = []
    first_at = None
    while engine.scheduler.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            first_at = first_at or time.time()
    done = time.time()
    engine.close()
    s = runner.stats
    report = {
        "role": "leader", "stage": 0, "rank": 0, "layers": list(model.layer_range), "steps": s.steps,
        "steps_not_waited": s.steps_not_waited, "busy_s": s.busy_s, "wait_s": s.wait_s, "bytes_out": s.bytes_out,
        "ttft_s": (first_at or done) - t0, "total_s": done - t0, "start": t0, "spans": s.step_spans,
        "blocks_leaked": engine.allocator.num_used,
    }  # fmt: skip
    return {"tokens": torch.tensor(tokens), "logits": torch.cat(logits)}, report


def _model_config(spec: SPPVerifySpec):
    from spindle_model import resolve_model

    return resolve_model(spec.model).config


def run_stage(spec: SPPVerifySpec, rank: int) -> dict:
    layout = spec.layout
    config = spp_engine_config(spec.engine_config(), _model_config(spec), spec.spp, spec.tp)
    stage_index, _ = layout.position(rank)
    model, _ = load_stage(config, spec.spp, stage_index, layout.stages[stage_index])
    stage = PipelineStage(model, layout, rank, num_blocks=config.kv_cache_tokens // BLOCK_SIZE, block_size=BLOCK_SIZE)
    stage.record_spans = True
    dist.barrier()
    stage.serve()
    s = stage.stats
    return {
        "role": "stage", "stage": stage_index, "rank": rank, "layers": list(model.layer_range), "steps": s.steps,
        "busy_s": s.busy_s, "wait_s": s.wait_s, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "spans": s.step_spans,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "spindle verify --spp", "an SPPVerifySpec as JSON")
    spec = SPPVerifySpec(**json.loads(args.spec.read_text()))
    join_gloo(args, spec.threads)
    try:
        if args.rank == 0:
            tensors, report = run_leader(spec)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(args.out / "rank0.safetensors"))
        else:
            report = run_stage(spec, args.rank)
        (args.out / f"rank{args.rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
