"""A KVP decode group driven as one engine (`KVPLeaderEngine` + followers) on local gloo processes (tests).

`group_engine_worker` runs under `spindle_model.testing.run_gloo`: rank 0 leads, the others follow. The leader
plays a script of calls before given steps (`play`): "resume" reserves a prefilled prompt and hands its KV (from
one full engine, as a prefill instance sends it) to the group; "abort" ends a request. The test plays the same
prompts on one engine. Each rank returns its blocks in use at the end; the leader also its tokens.
"""

from __future__ import annotations

import json

import torch

from ..config import EngineConfig
from ..engine import Engine
from ..sampling_params import SamplingParams
from .lockstep import KVPFollower, KVPLeaderEngine, load_member


def prefilled(config: EngineConfig, prompt: list[int], params: SamplingParams) -> tuple[int, torch.Tensor]:
    """A prompt's first token and KV (every head) from one full engine: what a prefill instance sends."""
    engine = Engine(config)
    engine.add_request("p", prompt, params, prefill_only=True)
    first = -1
    while engine.has_unfinished():
        for out in engine.step():
            first = out.new_token_ids[0]
    return first, engine.export_kv("p")


def play(leader: KVPLeaderEngine, ref_config: EngineConfig, script: list[dict]) -> dict[str, list[int]]:
    """Apply `script` entries ({"step": k, "op": resume|abort, ...}) before step k; run until done."""
    tokens: dict[str, list[int]] = {}
    step = 0
    last = max(e["step"] for e in script)
    while True:
        for e in (e for e in script if e["step"] == step):
            if e["op"] == "resume":
                params = SamplingParams(**e.get("params", {}))
                first, kv = prefilled(ref_config, e["prompt"], params)
                if not leader.reserve(e["id"], len(e["prompt"])):
                    raise RuntimeError(f"no room for {e['id']}")
                leader.add_prefilled(e["id"], e["prompt"], first, kv, params)
                tokens[e["id"]] = [first]
            elif e["op"] == "abort":
                leader.abort(e["id"])
        if not leader.requests and step > last:
            return tokens
        for out in leader.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1


def group_engine_worker(rank: int, world: int, config_json: str, kvp_tokens: int, script_json: str) -> dict:
    config = EngineConfig(**json.loads(config_json))
    ranks = {m: m for m in range(world)}
    member = load_member(config, rank, ranks, timeout_s=60.0)
    if rank > 0:
        KVPFollower(member, leader=0).serve()
        return {"blocks_used": torch.tensor([member.blocks_used])}
    leader = KVPLeaderEngine(config, member, kvp_tokens=kvp_tokens, keepalive_s=3600.0)
    leader.connect()
    ref_config = EngineConfig(model=config.model, block_size=config.block_size, kv_cache_tokens=4096)
    tokens = play(leader, ref_config, json.loads(script_json))
    leader.step()  # one more exchange: the followers report their blocks after the last finishes
    out = {f"tokens:{rid}": torch.tensor(t) for rid, t in tokens.items()}
    out["blocks_used"] = torch.tensor([member.blocks_used, leader.allocator.num_used])
    out["member_blocks_used"] = torch.tensor(list(leader.member_blocks_used.values()))
    out["scale_ups"] = torch.tensor([leader.scale_ups])
    leader.close()
    return out
