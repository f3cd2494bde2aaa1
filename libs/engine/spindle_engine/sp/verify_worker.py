"""One process of `spindle verify`: a prefill member running its side of the plan, or a decode TP rank.

Ranks `0..P-1` are the plan's members (sorted), ranks `P..P+T-1` the decode instance's TP ranks (none when
the KV is retained on one member, which then decodes in place). Every holder sends each decode rank its
heads of the KV it holds (no header exchange: both sides derive every size from the plan). With `kvp`,
ranks `P..` are the KVP members instead and each gets its token range (`verify_kvp`). Results go to
`<out>/rank<r>.safetensors` and `<out>/rank<r>.json`; nothing is pickled.

A spec file holding a JSON list runs every spec in turn on the same processes (one start and one model load
per process for all of them; results under `<out>/<i>/`). The world is the largest spec's; ranks past a
spec's own world sit that spec out. Every rank still walks every spec, as `new_group` is collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_model import LlamaModel, ModelConfig, load_state_dict, resolve_model

from ..config import DTYPES, EngineConfig
from ..engine import Engine
from ..kv_cache import BlockAllocator, KVCache
from ..sampling_params import SamplingParams
from .kv_parts import assemble_kv, decode_heads, split_for_decode
from .plan import SPPlan, retention_targets
from .runner import SPPrefill
from .verify_kvp import kvp_bounds, kvp_members, run_kvp_decode, send_kvp_parts

TAG_KV, TAG_FIRST = 7, 8
BLOCK_SIZE = 16


@dataclass(frozen=True)
class VerifySpec:
    model: str
    dtype: str
    plan: str
    layout: str
    token_ids: list[int]
    decode_tp: int = 1
    retain: list[int] | None = None
    max_new_tokens: int = 8
    dump_kv: bool = False
    threads: int = 1
    kvp: int = 0  # > 0: decode on a KVP group of this many members (TP 1 each) instead of one instance
    kvp_split: list[int] | None = None  # the members' range starts (from 0); default proportional to 1..kvp
    scale_up_at: int | None = None  # an extra idle member becomes the tail after this many generated tokens
    scale_down_at: int | None = None  # a member leaves the holders after this many generated tokens (its KV moves)
    scale_down_member: int | None = None  # which one; default the last prompt holder (kvp - 1)
    csa_drop: float | None = None  # CSA over a one-chunk all-to-all plan (0: exact; > 0: an approximation)
    csa_levels: int | None = None
    csa_rule: str = "doubling"  # the drop above level 2 (spindle_attention.csa.CSA_RULES)

    # where every rank runs: "cpu", "cuda" (rank r on GPU r mod the GPUs torch sees) or "cuda:N" (all on GPU N);
    # tensors between ranks cross the gloo group through host memory (p2p staging)
    device: str = "cpu"

    def parsed_plan(self) -> SPPlan:
        return SPPlan.parse(self.plan, len(self.token_ids), self.layout)

    @property
    def decode_in_place(self) -> bool:
        return self.retain is not None and len(self.retain) == 1 and self.decode_tp == 1 and not self.kvp

    def num_decode_ranks(self) -> int:
        if self.kvp:
            return kvp_members(self.kvp, self.scale_up_at)
        return 0 if self.decode_in_place else self.decode_tp

    def world_size(self) -> int:
        return len(self.parsed_plan().members) + self.num_decode_ranks()

    def placement(self) -> dict[int, Tensor]:
        plan = self.parsed_plan()
        if self.retain is not None:
            targets = retention_targets(plan.num_tokens, tuple(self.retain))
            return {m: targets.get(m, torch.empty(0, dtype=torch.int64)) for m in plan.members}
        return plan.final_placement()


def _inject_fault(model: LlamaModel, member: int) -> None:
    """Test hook: `SPINDLE_VERIFY_KILL=MEMBER:LAYER` kills that member the first time it reaches LAYER (mid-chunk)."""
    where = os.environ.get("SPINDLE_VERIFY_KILL")
    if not where:
        return
    victim, layer = (int(x) for x in where.split(":"))
    if victim != member:
        return
    target = model.layers[layer]
    if getattr(target, "_spindle_dying", False):  # a model shared by several specs is wrapped once
        return
    target._spindle_dying = True
    forward = target.forward
    calls = {"n": 0}

    def dying_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            print(f"member {member}: killed at layer {layer} (SPINDLE_VERIFY_KILL)", flush=True)
            os._exit(137)
        return forward(*args, **kwargs)

    target.forward = dying_forward


ModelLoader = Callable[[dist.ProcessGroup | None], LlamaModel]


class _Shared:
    """What the specs of one launch share in a process: decode TP groups and loaded models, keyed by TP group.

    Every spec of a launch has the same model and dtype (checked by `verify_many`), and no run changes a model.
    """

    def __init__(self, spec: VerifySpec, config: ModelConfig, path: Path, device: torch.device) -> None:
        self.dtype, self.config, self.path, self.device = DTYPES[spec.dtype], config, path, device
        self.groups: dict[tuple[int, int], dist.ProcessGroup | None] = {}
        self.models: dict[int, LlamaModel] = {}

    def tp_group(self, first: int, size: int) -> dist.ProcessGroup | None:
        """The decode instance's TP group. `new_group` is collective over the world, so every rank calls this."""
        if (first, size) not in self.groups:
            self.groups[first, size] = dist.new_group(list(range(first, first + size))) if size > 1 else None
        return self.groups[first, size]

    def model(self, tp_group: dist.ProcessGroup | None) -> LlamaModel:
        key = id(tp_group)
        if key not in self.models:
            model = LlamaModel(self.config, dtype=self.dtype, tp_group=tp_group, device=self.device)
            model.load_weights(load_state_dict(self.path, dtype=self.dtype))
            self.models[key] = model.eval()
        return self.models[key]


def _decode(spec: VerifySpec, model: LlamaModel, kv: Tensor, first: int) -> list[int]:
    """Greedy continuation on an engine that imports the prompt's KV, as a decode instance does."""
    n = len(spec.token_ids)
    room = n + spec.max_new_tokens + BLOCK_SIZE
    cfg = EngineConfig(dtype=spec.dtype, block_size=BLOCK_SIZE, kv_cache_tokens=room + BLOCK_SIZE, max_model_len=room,
                       device=str(model.device))  # fmt: skip
    engine = Engine(cfg, model=model)
    params = SamplingParams(max_tokens=spec.max_new_tokens, temperature=0.0, ignore_eos=True)
    assert engine.reserve("verify", n)
    engine.add_prefilled("verify", spec.token_ids, first, kv, params)
    tokens = [first]
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert engine.allocator.num_used == 0, "the decode engine leaked blocks"
    return tokens


def run_prefill(spec: VerifySpec, member: int, ranks: dict[int, int], config: ModelConfig, load: ModelLoader) -> tuple:
    plan = spec.parsed_plan()
    model = load(None)
    n = plan.num_tokens
    num_blocks = 2 * (-(-n // BLOCK_SIZE)) + 2  # history + chunk + retention copies never exceed 2x the prompt
    cache = KVCache(len(model.layers), num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim, DTYPES[spec.dtype],
                    device=model.device)  # fmt: skip
    allocator = BlockAllocator(num_blocks, BLOCK_SIZE)
    retain = retention_targets(n, tuple(spec.retain)) if spec.retain is not None else None
    sp = SPPrefill(model, cache, allocator, "verify", spec.token_ids, plan, member, ranks, retain,
                   csa_drop=spec.csa_drop, csa_levels=spec.csa_levels, csa_rule=spec.csa_rule)  # fmt: skip
    _inject_fault(model, member)
    try:
        logits = sp.run()
    except RuntimeError as e:  # a peer died mid-chunk; the runner has freed this member's blocks
        print(f"member {member}: prefill failed ({e}); blocks still held: {allocator.num_used}", flush=True)
        raise
    tensors: dict[str, Tensor] = {}
    report: dict = {
        "role": "prefill",
        "member": member,
        "chunks": [r.as_dict() for r in sp.reports],
        "transfer_bytes": 0,
    }
    first_holder = plan.last_token_member()
    first = torch.empty(1, dtype=torch.int64)
    if logits is not None:
        tensors["logits"] = logits
        first[0] = int(logits.argmax())
    kv = sp.held.export()  # [2, L, n_m, Hkv, D] in held order
    assert torch.equal(sp.held.positions, spec.placement()[member]), "held KV differs from the plan's placement"
    world = spec.world_size()
    P = len(plan.members)
    if spec.decode_in_place:
        owner = spec.retain[0]
        if member == first_holder and member != owner:
            p2p.isend(first, ranks[owner], tag=TAG_FIRST).wait()
        if member == owner:
            if member != first_holder:
                p2p.irecv(first, ranks[first_holder], tag=TAG_FIRST).wait()
            full = assemble_kv([(sp.held.positions, kv)], n)
            sp.release()
            tensors["tokens"] = torch.tensor(_decode(spec, model, full, int(first[0])))
    else:
        works, sent = [], 0
        if spec.kvp and len(sp.held):
            works = send_kvp_parts(kv, sp.held.positions, kvp_bounds(n, spec.kvp, spec.kvp_split), P)
            sent = kv.numel() * kv.element_size()
        elif len(sp.held):
            for t, part in enumerate(split_for_decode(kv, decode_heads(config, spec.decode_tp))):
                works.append(p2p.isend(part, P + t, tag=TAG_KV))
                sent += part.numel() * part.element_size()
        if member == first_holder:
            works += [p2p.isend(first, P + t, tag=TAG_FIRST) for t in range(world - P)]
        for w in works:
            w.wait()
        report["transfer_bytes"] = sent
    sp.release()
    report["blocks_leaked"] = allocator.num_used
    report["held_tokens"] = int(kv.shape[2])
    return tensors, report


def run_decode(
    spec: VerifySpec,
    t: int,
    ranks: dict[int, int],
    config: ModelConfig,
    load: ModelLoader,
    tp_group: dist.ProcessGroup | None,
) -> tuple:
    plan = spec.parsed_plan()
    T = spec.decode_tp
    model = load(tp_group)
    lo, hi = decode_heads(config, T)[t]
    dtype = DTYPES[spec.dtype]
    n = plan.num_tokens
    first_holder = plan.last_token_member()
    parts, works = [], []
    for m, pos in spec.placement().items():
        if pos.numel():
            buf = torch.empty(
                2, len(model.layers), pos.numel(), hi - lo, config.head_dim, dtype=dtype, device=model.device
            )
            works.append(p2p.irecv(buf, ranks[m], tag=TAG_KV))
            parts.append((pos, buf))
    first = torch.empty(1, dtype=torch.int64)
    works.append(p2p.irecv(first, ranks[first_holder], tag=TAG_FIRST))
    for w in works:
        w.wait()
    kv = assemble_kv(parts, n)
    tensors = {"tokens": torch.tensor(_decode(spec, model, kv, int(first[0])))}
    if spec.dump_kv:
        tensors["kv"] = kv
    received = sum(b.numel() * b.element_size() for _, b in parts)
    return tensors, {"role": "decode", "tp_rank": t, "received_bytes": received}


def run_spec(spec: VerifySpec, rank: int, shared: _Shared, out: Path) -> None:
    """This rank's part of `spec` (none when `rank` is past the spec's world), written under `out`."""
    members = sorted(spec.parsed_plan().members)
    ranks = {m: i for i, m in enumerate(members)}
    tp_group = None if spec.decode_in_place or spec.kvp else shared.tp_group(len(members), spec.decode_tp)
    config = shared.config
    if rank >= spec.world_size():
        return
    if rank < len(members):
        tensors, report = run_prefill(spec, members[rank], ranks, config, shared.model)
    elif spec.kvp:
        j, first = rank - len(members), len(members)
        tensors, report = run_kvp_decode(spec, j, ranks, config, shared.model(None), first, TAG_FIRST)
    else:
        tensors, report = run_decode(spec, rank - len(members), ranks, config, shared.model, tp_group)
    out.mkdir(parents=True, exist_ok=True)
    if tensors:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def worker_args(argv: list[str] | None, what: str, spec_help: str) -> argparse.Namespace:
    """The flags `run_ranks` starts every verify worker with."""
    ap = argparse.ArgumentParser(description=f"one process of `{what}` (started by it, not by hand)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--spec", type=Path, required=True, help=spec_help)
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def join_gloo(args: argparse.Namespace, threads: int) -> None:
    """Set the torch threads and join the loopback gloo group of the verify run (rank 0 hosts the store)."""
    torch.set_num_threads(threads)
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, args.rank == 0, timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world_size)


def rank_device(device: str, rank: int) -> torch.device:
    """The device of `rank` for a spec's `device`: "cuda" spreads the ranks over the GPUs torch sees (round-robin),
    "cuda:N" puts every rank on GPU N; the process's current CUDA device is set to it."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here (torch {torch.__version__})")
    index = rank % torch.cuda.device_count() if device == "cuda" else torch.device(device).index
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "spindle verify", "a VerifySpec as JSON, or a JSON list of them")
    raw = json.loads(args.spec.read_text())
    specs = [VerifySpec(**d) for d in raw] if isinstance(raw, list) else [VerifySpec(**raw)]
    join_gloo(args, specs[0].threads)
    try:
        source = resolve_model(specs[0].model)
        shared = _Shared(specs[0], source.config, source.path, rank_device(specs[0].device, args.rank))
        for i, spec in enumerate(specs):
            run_spec(spec, args.rank, shared, args.out / str(i) if isinstance(raw, list) else args.out)
            dist.barrier()  # the next spec's traffic starts only after every rank is done with this one
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
