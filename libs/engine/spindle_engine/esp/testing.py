"""Elastic groups on local gloo processes, driven by a script of iterations (tests).

`script_worker` runs under `spindle_model.testing.run_gloo`: every rank builds the same tiny-model engine, adds
the prompts as directed requests when a prefill names them, and plays the script. A step is either an iteration
`{"members": [ranks], "prefills": [[rid, {member: [start, end]}]], "chunks": [[rid, master, start, end]],
"decodes": [[rid, master]]}` (members are indices into "members"; ranks outside it skip the step; a chunk at 0 is
directed on its master) or a migration `{"migrate": [rid, src rank, dst rank]}`
(the KV and tokens go over plain point-to-point messages here; the elastic service uses its data plane). Each rank
returns the tokens it sampled (`tokens:<rid>`, `index:<rid>`), its blocks in use and its directed requests left.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..engine import Engine
from ..sampling_params import SamplingParams
from . import parts
from .iteration import ChunkWork, DecodeWork, PrefillWork, run_iteration


def _params(kind: str, max_tokens: int) -> SamplingParams:
    if kind == "seeded":
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def reference_tokens(prompts: dict[str, list[int]], kind: str, max_tokens: int, seed: int = 0) -> dict[str, list[int]]:
    """Each prompt's tokens from one engine on its own."""
    from spindle_model.testing import tiny_llama

    _, model = tiny_llama(seed)
    engine = Engine(EngineConfig(model="tiny", block_size=16, kv_cache_tokens=4096), model=model)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, _params(kind, max_tokens))
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def script_worker(rank: int, world: int, script_json: str) -> dict[str, torch.Tensor]:
    from spindle_model.testing import tiny_llama

    script = json.loads(script_json)
    prompts: dict[str, list[int]] = script["prompts"]
    kind, max_tokens = script["sampling"], script["max_tokens"]
    _, model = tiny_llama(script.get("seed", 0))
    config = EngineConfig(model="tiny", block_size=16, kv_cache_tokens=script.get("kv_tokens", 4096))
    engine = Engine(config, model=model)
    params = _params(kind, max_tokens)
    sampled: dict[str, dict[int, int]] = {}
    for batch_id, step in enumerate(script["steps"]):
        if "migrate" in step:
            _migrate(engine, rank, *step["migrate"], params)
            continue
        members = step["members"]
        if rank not in members:
            continue
        me = members.index(rank)
        prefills = [
            PrefillWork(rid, {int(m): (r[0], r[1]) for m, r in retain.items()})
            for rid, retain in step.get("prefills", [])
        ]
        for p in prefills:
            engine.add_directed(p.request_id, prompts[p.request_id], params)
        chunks = [ChunkWork(rid, m, s, e) for rid, m, s, e in step.get("chunks", [])]
        for c in chunks:
            if c.start == 0 and c.master == me:
                engine.add_directed(c.request_id, prompts[c.request_id], params)
        decodes = [DecodeWork(rid, m) for rid, m in step.get("decodes", [])]
        res = run_iteration(
            engine, me, members, prefills, decodes, chunks=chunks,
            aborted=set(step.get("aborted", {}).get(str(rank), [])), spec_of=lambda rid: rid.encode(),
            params_of=lambda _: params, batch_id=batch_id, timeout_s=30.0,
        )  # fmt: skip
        for o in res.outputs:
            sampled.setdefault(o.request_id, {})[o.index] = o.token
    out = {"blocks": torch.tensor([engine.allocator.num_used]), "directed": torch.tensor([len(engine.directed)])}
    for rid, toks in sampled.items():
        out[f"index:{rid}"] = torch.tensor(sorted(toks))
        out[f"tokens:{rid}"] = torch.tensor([toks[i] for i in sorted(toks)])
    return out


def _migrate(engine: Engine, rank: int, rid: str, src: int, dst: int, params: SamplingParams) -> None:
    if rank == src:
        seq = engine.directed[rid]
        pos, kv = parts.export_kv(engine, seq)
        meta = torch.tensor([len(seq.token_ids), seq.num_prompt_tokens, pos.numel()])
        for t in (meta, torch.tensor(seq.token_ids), pos, kv.contiguous()):
            dist.send(t, dst)
        parts.drop(engine, rid, "moved")
    elif rank == dst:
        meta = torch.empty(3, dtype=torch.int64)
        dist.recv(meta, src)
        n_tokens, n_prompt, n = meta.tolist()
        tokens, pos = torch.empty(n_tokens, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        dist.recv(tokens, src)
        dist.recv(pos, src)
        k = engine.cache.k
        kv = torch.empty(2, k.shape[0], n, k.shape[3], k.shape[4], dtype=k.dtype)
        dist.recv(kv, src)
        seq = parts.new_sequence(engine, rid, tokens.tolist(), n_prompt, params)
        parts.import_kv(engine, seq, pos, kv)
