"""A tensor-parallel lockstep engine on local gloo processes with the tiny random Llama (tests).

`lockstep_worker` runs under `spindle_model.testing.run_gloo`: rank 0 leads, the others follow. The leader
plays a script of calls at given steps (`run_script`), the same script the test plays on one full engine.
"""

from __future__ import annotations

import json

import torch

from spindle_attention.distributed.comm import RankGroup
from spindle_model import LlamaModel
from spindle_model.testing import tiny_llama

from ..config import EngineConfig
from ..engine import Engine
from ..sampling_params import SamplingParams
from .lockstep import TPFollower, TPLeaderEngine, tp_engine_config

CONFIG = EngineConfig(kv_cache_tokens=1024, block_size=4, max_model_len=256)


def prefilled(prompt: list[int], params: SamplingParams) -> tuple[int, torch.Tensor]:
    """A prompt's first token and KV (every head) from one full engine: what a prefill instance sends."""
    _, model = tiny_llama()
    engine = Engine(CONFIG, model=model)
    engine.add_request("p", prompt, params, prefill_only=True)
    while engine.has_unfinished():
        for out in engine.step():
            first = out.new_token_ids[0]
    return first, engine.export_kv("p")


def run_script(engine: Engine, script: list[dict]) -> dict[str, list[int]]:
    """Apply `script` entries ({"step": k, "op": add|resume|abort, ...}) before step k; run until done."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while True:
        for e in (e for e in script if e["step"] == step):
            params = SamplingParams(**e.get("params", {}))
            if e["op"] == "add":
                engine.add_request(e["id"], e["prompt"], params)
            elif e["op"] == "resume":
                first, kv = prefilled(e["prompt"], params)
                assert engine.reserve(e["id"], len(e["prompt"]))
                engine.add_prefilled(e["id"], e["prompt"], first, kv, params)
                tokens[e["id"]] = [first]
            elif e["op"] == "abort":
                engine.abort(e["id"])
        if not engine.scheduler.has_work() and step > max(e["step"] for e in script):
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1


def lockstep_worker(rank: int, world: int, script_json: str) -> dict[str, torch.Tensor]:
    hf, full = tiny_llama()
    group = RankGroup(tuple(range(world)))
    model = LlamaModel(full.config, tp_group=group)
    model.load_weights(hf.state_dict())
    if rank > 0:
        engine = Engine(tp_engine_config(CONFIG, model.config, world), model=model)
        TPFollower(engine, leader=0).serve()
        return {"blocks_used": torch.tensor([engine.allocator.num_used])}
    leader = TPLeaderEngine(CONFIG, model, group, keepalive_s=3600.0)
    tokens = run_script(leader, json.loads(script_json))
    leader.step()  # one more exchange: the followers report their blocks after the last finishes
    out = {f"tokens:{rid}": torch.tensor(t) for rid, t in tokens.items()}
    out["blocks_used"] = torch.tensor([leader.allocator.num_used])
    out["follower_blocks_used"] = torch.tensor(leader.follower_blocks_used)
    leader.close()
    return out
