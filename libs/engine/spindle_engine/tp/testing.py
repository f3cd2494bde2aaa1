"""A tensor-parallel lockstep engine on local gloo processes with the tiny random Llama (tests).

`lockstep_worker` runs under `spindle_model.testing.run_gloo`: rank 0 leads, the others follow. The leader
plays a script of calls at given steps (`run_script`), the same script the test plays on one full engine.
A `direct` entry imports a prefilled prompt as two holders' parts (even and odd positions) that reach every rank
directly, the leader playing both holders (on one engine it is a plain import).
"""

from __future__ import annotations

import itertools
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from spindle_attention.distributed.comm import RankGroup
from spindle_model import LlamaModel
from spindle_model.testing import tiny_llama

from ..config import EngineConfig
from ..engine import Engine
from ..sampling_params import SamplingParams
from ..sp.kv_parts import assemble_kv, split_for_decode
from .direct import to_runs
from .follower import TPFollower
from .lockstep import TPLeaderEngine, tp_engine_config

CONFIG = EngineConfig(kv_cache_tokens=1024, block_size=4, max_model_len=256)
DIRECT_TAG = 1000  # below any tag of the group collectives
_pool = ThreadPoolExecutor(4, thread_name_prefix="tp-test-recv")
_tags = itertools.count(DIRECT_TAG)
_sends: list[tuple[dist.Work, torch.Tensor]] = []


def raw_receiver(src: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype, cancel: threading.Event) -> Future:
    """A follower's receive of a directly sent part, plain irecv (the service uses the checked DataPlane)."""

    def recv() -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        dist.irecv(t, src, tag=tag).wait()
        return t

    return _pool.submit(recv)


def _import_direct(engine: TPLeaderEngine, rid: str, prompt: list[int], first: int, kv: torch.Tensor, params) -> None:
    """Play two holders (even and odd positions) sending each rank its heads; the leader keeps its own."""
    n = kv.shape[2]
    mine = []
    for pos in (torch.arange(0, n, 2), torch.arange(1, n, 2)):
        slices = split_for_decode(kv[:, :, pos], engine.heads)
        tags = [next(_tags) for _ in range(engine.tp_size)]
        engine.receive_direct(rid, 0, tags, to_runs(pos))
        for peer, part, tag in zip(engine.followers, slices[1:], tags[1:], strict=True):
            _sends.append((dist.isend(part, peer, tag=tag), part))
        mine.append((pos, slices[0]))
    engine.add_prefilled(rid, prompt, first, assemble_kv(mine, n), params)


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
            elif e["op"] in ("resume", "direct"):
                first, kv = prefilled(e["prompt"], params)
                assert engine.reserve(e["id"], len(e["prompt"]))
                if e["op"] == "direct" and isinstance(engine, TPLeaderEngine):
                    _import_direct(engine, e["id"], e["prompt"], first, kv, params)
                else:
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
        follower = TPFollower(engine, leader=0, receiver=raw_receiver)
        follower.serve()
        assert follower.direct is not None
        used, direct = engine.allocator.num_used, follower.direct.bytes
        return {"blocks_used": torch.tensor([used]), "direct_bytes": torch.tensor([direct])}
    leader = TPLeaderEngine(CONFIG, model, group, keepalive_s=3600.0)
    tokens = run_script(leader, json.loads(script_json))
    leader.step()  # one more exchange: the followers report their blocks after the last finishes
    out = {f"tokens:{rid}": torch.tensor(t) for rid, t in tokens.items()}
    out["blocks_used"] = torch.tensor([leader.allocator.num_used])
    out["follower_blocks_used"] = torch.tensor(leader.follower_blocks_used)
    out["follower_direct_bytes"] = torch.tensor(leader.follower_direct_bytes)
    out["direct_bytes"] = torch.tensor([leader.direct_bytes])
    out["forwarded_bytes"] = torch.tensor([leader.forwarded_bytes])
    for work, _ in _sends:
        work.wait()
    leader.close()
    return out
