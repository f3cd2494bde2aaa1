"""A re-sharding group on local gloo processes (tests): rank 0 leads a `ReshardingEngine` through a script of
prefills into the host tier, switches, onboarding, decode steps and parks; the other ranks `serve_member`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from spindle_model import load_state_dict, resolve_model

from ..config import EngineConfig
from ..sampling_params import SamplingParams
from .config import Parallel, ReshardPlan
from .group import ReshardingEngine, group_engine_config, serve_member
from .host_weights import HostWeights
from .tier import HostTier


def group_worker(rank: int, world: int, model_dir: str, plan_text: str, script_json: str, work: str) -> dict:
    """Script steps: ["prefill", [rid, ...]], ["switch", "TP2"], ["onboard", rid], ["decode", n], ["park", rid],
    ["refused", "PP2"] (a switch that must be refused: requests are on the group), ["prefetch", rid] (the ranks
    read it from the tier before its onboarding), ["abort", rid].
    Prompts are `prompts[rid]` of the script; greedy, `max_tokens` each."""
    script = json.loads(script_json)
    plan = ReshardPlan.parse(plan_text)
    model = resolve_model(model_dir).config
    config = group_engine_config(EngineConfig(model=model_dir, kv_cache_tokens=512, block_size=4, max_model_len=256),
                                 model, plan)  # fmt: skip
    tier_dir = Path(work) / "tier"
    if rank == 0:
        tier_dir.mkdir(parents=True, exist_ok=True)
        HostWeights.publish(load_state_dict(Path(model_dir)), tier_dir / "weights")
    dist.barrier()
    weights = HostWeights(tier_dir / "weights")
    if rank != 0:
        serve_member(config, model, 0, rank, weights, tier_dir)
        return {}
    tier = HostTier(tier_dir, model, config.torch_dtype, script["tier_tokens"])
    group = ReshardingEngine(config, model, plan, 0, weights, tier)
    params = SamplingParams(max_tokens=script["max_tokens"], temperature=0.0)
    tokens: dict[str, list[int]] = {}
    refused = 0
    for op, arg in script["steps"]:
        if op == "prefill":
            outs = group.prefill_to_tier([(rid, script["prompts"][rid], params) for rid in arg])
        elif op == "decode":
            outs = [o for _ in range(arg) for o in group.decode_step()]
        else:
            outs = []
            if op == "switch":
                group.switch(Parallel.parse(arg))
            elif op == "refused":  # a switch while requests are on the group
                try:
                    group.switch(Parallel.parse(arg))
                except ValueError:
                    refused += 1
            elif op == "onboard":
                group.onboard(arg)
            elif op == "park":
                group.park(arg)
            elif op == "prefetch":
                group.prefetch(arg).result(60)
            elif op == "abort":
                group.abort(arg)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    out = {f"tokens:{rid}": torch.tensor(t) for rid, t in tokens.items()}
    out["switch_s"] = torch.tensor([s.seconds for s in group.switches])
    out["switch_bytes"] = torch.tensor([s.weight_bytes for s in group.switches])
    out["tier"] = torch.tensor([tier.bytes_in, tier.bytes_out, tier.used_tokens, len(tier.entries)])
    out["blocks_used"] = torch.tensor([group.allocator.num_used])
    out["refused"] = torch.tensor([refused])
    out["prefetch_s"] = torch.tensor(group.prefetch_seconds())
    out["files_left"] = torch.tensor([len([p for p in tier_dir.iterdir() if p.suffix == ".kv"])])
    group.close()
    return out
