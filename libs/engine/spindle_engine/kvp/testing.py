"""A KVP group on local gloo processes with every member computing the prompts itself (tests, benches).

`group_worker` runs under `spindle_model.testing.run_gloo`: member = rank. Each member computes every
prompt's KV with one causal forward pass, keeps only its ranges, then all members decode in lockstep,
applying the scale-ups at the step they name. Each rank returns its mastered requests' tokens
(`tokens:<id>`) and logits (`logits:<id>`), its blocks in use after the run, and its byte counters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from spindle_model import CausalAttention, LlamaModel, load_state_dict, resolve_model

from ..sampler import sample
from ..sampling_params import SamplingParams
from ..sequence import Sequence
from .decoder import KVPMember
from .plan import KVPRequest


@dataclass(frozen=True)
class GroupRequest:
    request_id: str
    token_ids: list[int]
    master: int
    members: list[int]  # holders of the prompt KV, in range order
    bounds: list[int]  # len(members) + 1 offsets, from 0 to len(token_ids)
    max_tokens: int
    scale_up: list[list[int]] | None = None  # [[step, member], ...]: member becomes the tail before that step
    temperature: float = 0.0
    seed: int | None = None


class _Recording:
    def __init__(self) -> None:
        self.kv: list[tuple[Tensor, Tensor]] = []

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.kv.append((k, v))
        return CausalAttention().attention(layer, q, k, v)


@torch.inference_mode()
def prompt_kv(model: LlamaModel, ids: list[int]) -> tuple[Tensor, Tensor]:
    """`ids`' KV `[2, L, n, Hkv, D]` and the last token's logits `[vocab]`."""
    rec = _Recording()
    hidden = model(torch.arange(len(ids)), rec, input_ids=torch.tensor(ids))
    kv = torch.stack([torch.stack([k for k, _ in rec.kv]), torch.stack([v for _, v in rec.kv])])
    return kv, model.compute_logits(hidden[-1:])[0]


def encode_requests(requests: list[GroupRequest]) -> str:
    return json.dumps([asdict(r) for r in requests])


def group_worker(rank: int, world: int, model_dir: str, requests_json: str) -> dict[str, Tensor]:
    requests = [GroupRequest(**r) for r in json.loads(requests_json)]
    source = resolve_model(model_dir)
    model = LlamaModel(source.config)
    model.load_weights(load_state_dict(source.path))
    longest = max(len(r.token_ids) + r.max_tokens for r in requests)
    dec = KVPMember(
        model, rank, {m: m for m in range(world)}, num_blocks=4 * len(requests) * (longest // 16 + 2),
        max_model_len=longest + 1, keep_logits=True,
    )  # fmt: skip
    for r in requests:
        kv, logits = prompt_kv(model, r.token_ids)
        req = KVPRequest.split(r.request_id, r.master, r.members, r.bounds)
        mine = req.range_of(rank)
        part = kv[:, :, mine.start : mine.end] if mine is not None else None
        params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed, ignore_eos=True)
        prompt = Sequence(r.request_id, list(r.token_ids), params)  # the first token, sampled as the engine does
        first = sample(logits[None], [prompt], torch.Generator().manual_seed(0)).tokens[0]
        tokens = [*r.token_ids, first]
        dec.add_request(req, part, token_ids=tokens, num_prompt_tokens=len(r.token_ids), params=params)
    tokens: dict[str, list[int]] = {rid: [s.token_ids[-1]] for rid, s in dec.seqs.items()}
    ups = {(step, r.request_id): m for r in requests for step, m in (r.scale_up or [])}
    step = 0
    while dec.has_unfinished():
        for (at, rid), member in ups.items():
            if at == step and rid in dec.plan.requests:
                dec.scale_up(rid, member)
        for out in dec.step():
            tokens[out.request_id].append(out.token)
        step += 1
    dec.shard.allocator.check_invariants()
    out: dict[str, Tensor] = {f"tokens:{rid}": torch.tensor(t) for rid, t in tokens.items()}
    out.update({f"logits:{rid}": torch.stack(ls) for rid, ls in dec.logits.items() if ls})
    out["blocks_used"] = torch.tensor(dec.blocks_used)
    s = dec.stats
    out["bytes"] = torch.tensor([s.q_bytes, s.kv_bytes, s.result_bytes, s.control_bytes, s.kv_move_bytes, step])
    return out
