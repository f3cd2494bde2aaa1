"""A KVP decode group driven as one engine (`KVPLeaderEngine` + followers) on local gloo processes (tests).

`group_engine_worker` runs under `spindle_model.testing.run_gloo`: rank 0 leads, the others follow. The leader
plays a script of calls before given steps (`play`): "resume" reserves a prefilled prompt and hands its KV (from
one full engine, as a prefill instance sends it) to the group; "abort" ends a request; "scale_down" asks the
leader to take a member off a request's holders (`request_scale_down`). The test plays the same prompts on one
engine. Each rank returns its blocks in use at the end and the KV it moved in scale-downs (bytes, tokens); the
leader also its tokens and its counters.

`group_kill_worker` (under `run_survivors`, which expects a rank to die) plays a script too, but one follower
ends its process in the middle of a given step (inside its first partial attention of that step, or with
`kill_in_move` before it sends the KV of a scale-down); the leader also returns each request's placement and
which requests failed.
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from ..config import EngineConfig
from ..engine import Engine
from ..sampling_params import SamplingParams
from .follower import KVPFollower
from .lockstep import KVPLeaderEngine, load_member


def prefilled(config: EngineConfig, prompt: list[int], params: SamplingParams) -> tuple[int, torch.Tensor]:
    """A prompt's first token and KV (every head) from one full engine: what a prefill instance sends."""
    engine = Engine(config)
    engine.add_request("p", prompt, params, prefill_only=True)
    first = -1
    while engine.has_unfinished():
        for out in engine.step():
            first = out.new_token_ids[0]
    return first, engine.export_kv("p")


def play(
    leader: KVPLeaderEngine,
    ref_config: EngineConfig,
    script: list[dict],
    failed: dict[str, str] | None = None,
    placements: dict[str, list[list[int]]] | None = None,
    logprobs: dict[str, list[float]] | None = None,
) -> dict[str, list[int]]:
    """Apply `script` entries ({"step": k, "op": resume|abort, ...}) before step k; run until done. Requests the
    group fails go to `failed` (id -> message); what `placement_changes` reports after each step to `placements`
    (id -> [master, member, start, end, member, start, end, ...] per report); the sampled tokens' logprobs of the
    requests that asked for them to `logprobs` (id -> one per decode step)."""
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
            elif e["op"] == "scale_down" and not leader.request_scale_down(e["id"], e["member"], e.get("into")):
                raise RuntimeError(f"no room to take member {e['member']} off {e['id']}")
        if not leader.requests and step > last:
            return tokens
        for out in leader.step():
            tokens[out.request_id] += out.new_token_ids
            if logprobs is not None and out.logprobs:
                logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs)
        for q in leader.placement_changes():
            if placements is not None:
                ranges = [x for r in q.ranges for x in (r.member, r.start, r.end)]
                placements.setdefault(q.request_id, []).append([q.master, *ranges])
        for rid, message in leader.take_failures():
            if failed is None:
                raise RuntimeError(f"{rid} failed: {message}")
            failed[rid] = message
        step += 1


def group_engine_worker(
    rank: int, world: int, config_json: str, kvp_tokens: int, script_json: str, scale_down_tokens: int = 0
) -> dict:
    config = EngineConfig(**json.loads(config_json))
    ranks = {m: m for m in range(world)}
    member = load_member(config, rank, ranks, timeout_s=60.0)
    if rank > 0:
        KVPFollower(member, leader=0).serve()
        moved = [member.stats.scale_down_bytes, member.stats.scale_down_tokens]
        return {"blocks_used": torch.tensor([member.blocks_used]), "moved": torch.tensor(moved)}
    leader = KVPLeaderEngine(
        config, member, kvp_tokens=kvp_tokens, scale_down_tokens=scale_down_tokens, keepalive_s=3600.0
    )  # fmt: skip
    leader.connect()
    ref_config = EngineConfig(model=config.model, block_size=config.block_size, kv_cache_tokens=4096)
    placements: dict[str, list[list[int]]] = {}
    logprobs: dict[str, list[float]] = {}
    tokens = play(leader, ref_config, json.loads(script_json), placements=placements, logprobs=logprobs)
    leader.step()  # one more exchange: the followers report their blocks after the last finishes
    out = {f"tokens:{rid}": torch.tensor(t) for rid, t in tokens.items()}
    out |= {f"logprobs:{rid}": torch.tensor(v, dtype=torch.float64) for rid, v in logprobs.items()}
    out |= {f"reports:{rid}": torch.tensor([len(r)]) for rid, r in placements.items()}
    out |= {f"placement:{rid}": torch.tensor(r[-1]) for rid, r in placements.items()}
    out["blocks_used"] = torch.tensor([member.blocks_used, leader.allocator.num_used])
    out["member_blocks_used"] = torch.tensor(list(leader.member_blocks_used.values()))
    out["scale_ups"] = torch.tensor([leader.scale_ups])
    out["scale_downs"] = torch.tensor([leader.scale_downs])
    out["moved"] = torch.tensor([member.stats.scale_down_bytes, member.stats.scale_down_tokens])
    leader.close()
    return out


def group_kill_worker(
    rank: int,
    world: int,
    config_json: str,
    kvp_tokens: int,
    script_json: str,
    victim: int,
    kill_step: int,
    kill_in_move: bool = False,
) -> dict:
    config = EngineConfig(**json.loads(config_json))
    member = load_member(config, rank, {m: m for m in range(world)}, timeout_s=60.0)
    if rank == victim:
        steps = [0]
        step, attend = member.step, member.shard.attend

        def counting_step() -> list:
            steps[0] += 1
            if steps[0] > kill_step + 1:  # it attended nothing in the kill step
                os._exit(9)
            return step()

        def dying_attend(*args: object, **kwargs: object) -> object:
            if steps[0] >= kill_step:
                os._exit(9)  # mid-step: its peers wait for this layer's partial states
            return attend(*args, **kwargs)

        move = member._move_kv

        def dying_move() -> None:
            if kill_in_move and steps[0] >= kill_step:
                os._exit(9)  # its scale-down's receiver waits for the KV
            move()

        member.step, member.shard.attend = counting_step, dying_attend  # type: ignore[method-assign]
        member._move_kv = dying_move  # type: ignore[method-assign]
    if rank > 0:
        KVPFollower(member, leader=0).serve()
        return {"blocks_used": torch.tensor([member.blocks_used])}
    leader = KVPLeaderEngine(config, member, kvp_tokens=kvp_tokens, keepalive_s=3600.0)
    leader.connect()
    ref_config = EngineConfig(model=config.model, block_size=config.block_size, kv_cache_tokens=4096)
    script = json.loads(script_json)
    failed: dict[str, str] = {}
    placed: dict[str, list[int]] = {}
    resume = leader.resume

    def recording_resume(request_id: str, *args: object, **kwargs: object) -> None:
        resume(request_id, *args, **kwargs)  # type: ignore[arg-type]
        req = member.plan.requests[request_id]
        placed[request_id] = [req.master, *(r.member for r in req.ranges)]

    leader.resume = recording_resume  # type: ignore[method-assign]
    tokens = play(leader, ref_config, script, failed)
    leader.step()  # one more exchange: the followers report their blocks after the last finishes
    out = {f"tokens:{rid}": torch.tensor(t) for rid, t in tokens.items()}
    out |= {f"placed:{rid}": torch.tensor(p) for rid, p in placed.items()}
    out |= {f"failed:{rid}": torch.tensor([1]) for rid in failed}
    out["blocks_used"] = torch.tensor([member.blocks_used, leader.allocator.num_used])
    out["num_blocks"] = torch.tensor([leader.allocator.num_blocks])
    out["member_blocks_used"] = torch.tensor(list(leader.member_blocks_used.items())).view(-1, 2)
    out["gone"] = torch.tensor(sorted(leader.gone))
    leader.close()
    return out


def _survivor_entry(rank: int, fn: Callable[..., dict], world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()  # torch.multiprocessing would keep it for a join() that is not called here
        raise
    if result:
        save_file({k: v.contiguous() for k, v in result.items()}, str(Path(out_dir) / f"rank{rank}.safetensors"))
    os._exit(0)  # no barrier or process-group teardown: a peer is dead


def run_survivors(
    fn: Callable[..., dict], world: int, out_dir: Path, *args: object, timeout: float = 300.0
) -> list[dict]:
    """Like `spindle_model.testing.run_gloo`, for runs where a rank dies: each rank's results ({} if none)."""
    from spindle_model.testing import free_port

    ctx = mp.start_processes(
        _survivor_entry, args=(fn, world, free_port(), str(out_dir), args), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    for p in ctx.processes:
        p.join(timeout)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    results = []
    for r in range(world):
        f = Path(out_dir) / f"rank{r}.safetensors"
        results.append(load_file(str(f)) if f.exists() else {})
    return results
