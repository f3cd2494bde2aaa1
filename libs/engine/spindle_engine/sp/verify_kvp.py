"""`spindle verify --kvp K [--scale-up-at N] [--scale-down-at N]`: the decode side as a KVP group of K members.

The prompt KV is split by token ranges over the K members (proportional to 1..K unless `kvp_split` gives
the range starts; either way not block-aligned in general). Each prefill holder sends decode member j the
entries of its KV whose positions fall in j's range; sizes follow from the plan's placement, so no header
travels. Member 0 masters the request (so the new k/v travel to a remote tail), member K-1 is the tail;
with `scale_up_at`, an extra member K starts idle and becomes the tail before the step that computes the
KV of the N-th generated token. With `scale_down_at`, member `scale_down_member` (default K-1, the last prompt
holder) leaves the holders before that step: its range's KV moves once to the adjacent holder (plan.py), which
appends it to its own range, or puts it in front when the leaver held the first range. The master returns the
tokens and every step's logits; each member reports the KV it moved.
"""

from __future__ import annotations

import os
from itertools import pairwise

import torch
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_model import LlamaModel, ModelConfig

from ..config import DTYPES
from ..kvp import KVPMember, KVPRequest, parse_bounds, proportional_bounds
from ..sampling_params import SamplingParams
from .kv_parts import assemble_kv

TAG_KVP_PART = 9


def kvp_bounds(num_tokens: int, kvp: int, split: list[int] | None) -> list[int]:
    """`kvp + 1` range bounds over the prompt."""
    if split is not None:
        bounds = parse_bounds(",".join(map(str, split)), num_tokens)
        if len(bounds) != kvp + 1:
            raise ValueError(f"--kvp-split gives {len(bounds) - 1} ranges for --kvp {kvp}")
        return bounds
    return proportional_bounds(num_tokens, list(range(1, kvp + 1)))


def kvp_members(kvp: int, scale_up_at: int | None) -> int:
    return kvp + (1 if scale_up_at is not None else 0)


def scale_down_member(spec) -> int:
    return spec.kvp - 1 if spec.scale_down_member is None else spec.scale_down_member


def check_scale_down(spec) -> None:
    """ValueError for `--scale-down-at` / `--scale-down-member` values that cannot run (spec: a VerifySpec)."""
    if spec.scale_down_at is None:
        if spec.scale_down_member is not None:
            raise ValueError("--scale-down-member needs --scale-down-at")
        return
    if not spec.kvp:
        raise ValueError("--scale-down-at needs --kvp")
    if not 1 <= spec.scale_down_at < spec.max_new_tokens:
        limit = spec.max_new_tokens
        raise ValueError(f"--scale-down-at must be in [1, {limit}) (--max-new-tokens), got {spec.scale_down_at}")
    member = scale_down_member(spec)
    size = kvp_members(spec.kvp, spec.scale_up_at)
    if not 0 <= member < size:
        raise ValueError(f"--scale-down-member must be a KVP member in [0, {size}), got {member}")
    if size == 1:
        raise ValueError("--scale-down-at needs two KV holders (--kvp 2 or more, or a scale-up first)")
    if member == spec.kvp and (spec.scale_up_at is None or spec.scale_up_at >= spec.scale_down_at):
        raise ValueError(f"member {member} holds KV only after --scale-up-at; it cannot leave before")


def send_kvp_parts(kv: Tensor, positions: Tensor, bounds: list[int], first_rank: int) -> list:
    """Prefill side: send decode member j (rank `first_rank + j`) this holder's entries in its range."""
    works = []
    for j, (lo, hi) in enumerate(pairwise(bounds)):
        mask = (positions >= lo) & (positions < hi)
        if bool(mask.any()):
            works.append(p2p.isend(kv[:, :, mask].contiguous(), first_rank + j, tag=TAG_KVP_PART))
    return works


def receive_kvp_range(
    placement: dict[int, Tensor],
    ranks: dict[int, int],
    lo: int,
    hi: int,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor, int]:
    """Decode side: this member's range `[lo, hi)` from every prefill holder -> (`[2, L, hi-lo, Hkv, D]`, bytes)."""
    layers, hkv, d = shape
    parts, works = [], []
    for m, pos in placement.items():
        mine = pos[(pos >= lo) & (pos < hi)]
        if mine.numel():
            buf = torch.empty(2, layers, mine.numel(), hkv, d, dtype=dtype, device=device)
            works.append(p2p.irecv(buf, ranks[m], tag=TAG_KVP_PART))
            parts.append((mine - lo, buf))
    for w in works:
        w.wait()
    return assemble_kv(parts, hi - lo), sum(b.numel() * b.element_size() for _, b in parts)


def _kill_step(member: int) -> int | None:
    """Test hook: `SPINDLE_VERIFY_KILL_KVP=MEMBER:STEP` kills that KVP member just before that decode step."""
    where = os.environ.get("SPINDLE_VERIFY_KILL_KVP")
    if not where:
        return None
    victim, step = (int(x) for x in where.split(":"))
    return step if victim == member else None


def run_kvp_decode(
    spec, j: int, ranks: dict[int, int], config: ModelConfig, model: LlamaModel, first_rank: int, tag_first: int
) -> tuple:
    """Decode member `j` of `spec` (a VerifySpec with `kvp`) at rank `first_rank + j`; (tensors, report)."""
    dtype = DTYPES[spec.dtype]
    n = len(spec.token_ids)
    bounds = kvp_bounds(n, spec.kvp, spec.kvp_split)
    size = kvp_members(spec.kvp, spec.scale_up_at)
    first = torch.empty(1, dtype=torch.int64)
    first_work = p2p.irecv(first, ranks[spec.parsed_plan().last_token_member()], tag=tag_first)
    kv, received = None, 0
    if j < spec.kvp:
        shape = (len(model.layers), config.num_kv_heads, config.head_dim)
        kv, received = receive_kvp_range(spec.placement(), ranks, bounds[j], bounds[j + 1], shape, dtype, model.device)
    first_work.wait()
    room = n + spec.max_new_tokens + 16
    dec = KVPMember(
        model, j, {m: first_rank + m for m in range(size)}, num_blocks=2 * (room // 16 + 2), block_size=16,
        max_model_len=room, keep_logits=True,
    )  # fmt: skip
    req = KVPRequest.split("verify", 0, list(range(spec.kvp)), bounds)
    params = SamplingParams(max_tokens=spec.max_new_tokens, temperature=0.0, ignore_eos=True)
    dec.add_request(req, kv, token_ids=[*spec.token_ids, int(first[0])], num_prompt_tokens=n, params=params)
    tokens, step = [int(first[0])], 0
    kill_at = _kill_step(j)
    try:
        while dec.has_unfinished():
            if step == kill_at:
                print(f"KVP member {j}: killed before step {step} (SPINDLE_VERIFY_KILL_KVP)", flush=True)
                os._exit(137)
            if spec.scale_up_at is not None and step == spec.scale_up_at - 1:
                dec.scale_up("verify", spec.kvp)
            if spec.scale_down_at is not None and step == spec.scale_down_at - 1:
                dec.scale_down("verify", scale_down_member(spec))
            tokens += [o.token for o in dec.step()]
            step += 1
    except RuntimeError as e:  # gloo reports a dead member as a closed connection at the next exchange with it
        dec.abort_all()
        print(f"KVP member {j}: decode failed at step {step} ({e}); blocks still held: {dec.blocks_used}", flush=True)
        raise
    held = dec.shard.request_ids
    dec.shard.allocator.check_invariants()
    tensors: dict[str, Tensor] = {}
    if j == 0:
        tensors["tokens"] = torch.tensor(tokens)
        if dec.logits["verify"]:
            tensors["decode_logits"] = torch.stack(dec.logits["verify"])
    if spec.dump_kv and kv is not None:
        tensors["kv"] = kv
    s = dec.stats
    report = {
        "role": "kvp",
        "member": j,
        "range": [bounds[j], bounds[j + 1]] if j < spec.kvp else [],
        "received_bytes": received,
        "steps": step,
        "q_bytes": s.q_bytes,
        "kv_bytes": s.kv_bytes,
        "result_bytes": s.result_bytes,
        "control_bytes": s.control_bytes,
        "kv_move_bytes": s.kv_move_bytes,
        "scale_down_bytes": s.scale_down_bytes,
        "scale_down_tokens": s.scale_down_tokens,
        "step_s": s.step_s,
        "blocks_leaked": dec.blocks_used + len(held),
    }
    return tensors, report
