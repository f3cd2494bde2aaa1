"""One member's side of a sequence-parallel prefill: runs its chunks of a plan collectively with the group.

Every member of a chunk calls `run_chunk(k)` for it (in plan order); members not in chunk k skip it. The
member runs the model on its shard of the chunk's tokens with `SPAttentionContext`, so each layer's
attention spans every member's shard plus all history KV. Its KV stays in its `HeldKV` (engine blocks);
after the last chunk `held` has exactly the positions `SPPlan.final_placement` (or the retention targets)
names, and the member that computed the prompt's last token returns its logits.

`csa_drop` runs a one-chunk all-to-all plan with CSPS's sparse CSA (`spindle_attention.csa`): the chunk's
members, in plan order, are the segments; `csa_levels` levels (default all); 0 is exact dense attention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spindle_attention.distributed import CommStats, RankGroup
from spindle_attention.distributed.comm import RANK_GROUP_TAG
from spindle_model import LlamaModel

from ..kv_cache import BlockAllocator, KVCache
from .context import SPAttentionContext
from .csa_plan import csa_levels_for, dropped_at_level2
from .held_kv import HeldKV
from .plan import SPPlan
from .rebalance import Rebalance


@dataclass
class ChunkReport:
    """What one member measured for one chunk (bytes this member sent; host seconds).

    `seconds` runs from when this member starts the chunk, so it includes waiting for members that start
    later (`spindle profile` puts a barrier first and keeps the slowest member's time)."""

    index: int
    tokens: int  # this member's shard
    sp: int
    layout: str
    seconds: float
    attention_s: float = 0.0
    ring_bytes: int = 0  # ring / all-to-all bytes sent (all layers)
    ring_payload_bytes: int = 0  # the useful part of them (the theoretical volume)
    rebalance_bytes: int = 0
    rebalance_wait_s: float = 0.0
    retained_tokens: int = 0
    csa_dropped_tokens: int = 0  # CSA: this member's tokens dropped at level 2 (per dropping layer and head)
    bytes_by_phase: dict[str, int] = field(default_factory=dict)  # CSA: bytes sent per level, forward and back

    def as_dict(self) -> dict[str, float | int | str]:
        return dict(self.__dict__)


@dataclass
class SPPrefill:
    model: LlamaModel
    cache: KVCache
    allocator: BlockAllocator
    request_id: str
    token_ids: list[int]
    plan: SPPlan
    member: int
    ranks: dict[int, int]  # member -> data-plane (global) rank
    retain: dict[int, Tensor] | None = None  # member -> positions it keeps after the last chunk (ring only)
    # with `retain`: keep what this member retains in `retained` (positions, KV [2, layers, n, Hkv, D]) instead
    # of its blocks, its shard's blocks given back (an elastic group writes several prompts' ranges afterwards)
    defer_retained: bool = False
    retained: tuple[Tensor, Tensor] | None = None
    tag_base: int = RANK_GROUP_TAG  # the ring's tags (an elastic group gives each iteration its own)
    csa_drop: float | None = None  # CSA's drop ratio p at level 2 (None: plain SP)
    csa_levels: int | None = None  # CSA's levels (None: every level)
    csa_rule: str = "doubling"  # CSA's drop above level 2 (`spindle_attention.csa.CSA_RULES`)
    reports: list[ChunkReport] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.plan.num_tokens != len(self.token_ids):
            raise ValueError(f"the plan covers {self.plan.num_tokens} tokens, the prompt has {len(self.token_ids)}")
        missing = [m for m in self.plan.members if m not in self.ranks]
        if missing:
            raise ValueError(f"plan members {missing} have no data-plane rank")
        if self.retain is not None:
            covered = torch.cat(list(self.retain.values())) if self.retain else torch.empty(0, dtype=torch.int64)
            if not torch.equal(torch.sort(covered).values, torch.arange(self.plan.num_tokens)):
                raise ValueError("retention targets must cover every prompt position exactly once")
            if not set(self.retain) <= set(self.plan.members):
                raise ValueError(f"retention members {sorted(self.retain)} are not all plan members")
            if self.plan.chunks[-1].attention != "ring":
                raise ValueError("KV retention needs a ring layout in the last chunk, not all-to-all")
        self.csa = (
            csa_levels_for(self.plan, self.csa_drop, self.csa_levels, self.csa_rule)
            if self.csa_drop is not None
            else None
        )
        self.held = HeldKV(self.cache, self.allocator, self.request_id)
        self.steps = self.plan.steps()
        self._ids = torch.tensor(self.token_ids, dtype=torch.int64, device=self.model.device)

    @property
    def chunk_indices(self) -> list[int]:
        """The chunks this member takes part in."""
        return [s.index for s in self.steps if self.member in s.chunk.members]

    @torch.inference_mode()
    def run_chunk(self, index: int) -> Tensor | None:
        """Run chunk `index` with its group. Returns fp32 logits `[vocab]` on the member that computed the
        prompt's last token in the last chunk, else None."""
        step = self.steps[index]
        chunk, m = step.chunk, self.member
        if m not in chunk.members:
            return None
        t0 = time.perf_counter()
        group = RankGroup(tuple(self.ranks[x] for x in chunk.members), self.tag_base) if chunk.sp > 1 else None
        num_layers = len(self.model.layers)
        rebalance = None
        if step.moves:
            incoming = step.history[m][len(self.held) :] if any(mv.dst == m for mv in step.moves) else None
            rebalance = Rebalance(
                step.moves, m, self.ranks, self.held,
                incoming if incoming is not None else torch.empty(0, dtype=torch.int64), num_layers,
            )  # fmt: skip
        assert torch.equal(self.held.positions, step.history[m]), "held KV diverged from the plan"
        num_history = len(self.held)
        positions = step.shards[m]  # [T]
        new_slots = self.held.grow(positions)
        last = index == len(self.steps) - 1
        stats = CommStats()
        ctx = SPAttentionContext(
            self.held, group, chunk.attention,
            first_layer=self.model.layer_range[0], num_history=num_history, new_slots=new_slots,
            positions=positions, rebalance=rebalance, stats=stats,
            csa=(self.csa, self.model.layer_range[1] - 1) if self.csa is not None else None,
            retain=self.retain.get(m, torch.empty(0, dtype=torch.int64)) if last and self.retain is not None else None,
        )  # fmt: skip
        if positions.numel():
            hidden = self.model(positions, ctx, input_ids=self._ids[positions])  # [T, H]
        else:  # a prompt shorter than the group: no tokens here, but this member still passes the ring's KV on
            self._attend_nothing(ctx)
        if rebalance is not None:
            rebalance.finish()
        if ctx.retain is not None:
            self._keep_retained(ctx)
        logits = None
        if last:
            hit = (positions == self.plan.num_tokens - 1).nonzero()
            if hit.numel():
                logits = self.model.compute_logits(hidden[hit[0]])[0]
        self.reports.append(
            ChunkReport(
                index, positions.numel(), chunk.sp, chunk.layout, time.perf_counter() - t0,
                attention_s=ctx.attention_s, ring_bytes=stats.bytes_sent,
                ring_payload_bytes=sum(stats.step_payload_bytes),
                rebalance_bytes=rebalance.bytes_sent if rebalance else 0,
                rebalance_wait_s=rebalance.wait_s if rebalance else 0.0,
                retained_tokens=len(self.held) if ctx.retain is not None else 0,
                csa_dropped_tokens=self._csa_dropped(), bytes_by_phase=dict(stats.bytes_by_phase),
            )
        )  # fmt: skip
        return logits

    def _csa_dropped(self) -> int:
        return dropped_at_level2(self.csa, self.plan.chunks[0].members.index(self.member)) if self.csa else 0

    def _attend_nothing(self, ctx: SPAttentionContext) -> None:
        m = self.model
        d = m.config.head_dim
        for layer in m.layers:
            q = torch.empty(0, m.num_local_q_heads, d, dtype=m.dtype, device=m.device)
            kv = torch.empty(0, m.num_local_kv_heads, d, dtype=m.dtype, device=m.device)
            ctx.attention(layer.layer_id, q, kv, kv)

    def run_chunk_or_release(self, index: int) -> Tensor | None:
        """`run_chunk`, giving back every block held for the request if it fails (e.g. a peer died)."""
        try:
            return self.run_chunk(index)
        except BaseException:
            self.release()
            raise

    def run(self) -> Tensor | None:
        """Run every chunk this member takes part in; returns the last token's logits where computed here.

        If a chunk fails (a peer died: its connections close and our waits raise), every block this member
        held for the request is given back before the error propagates."""
        logits = None
        for k in self.chunk_indices:
            out = self.run_chunk_or_release(k)
            logits = out if out is not None else logits
        return logits

    def _keep_retained(self, ctx: SPAttentionContext) -> None:
        """Replace the held KV by what this member retained (possibly nothing)."""
        self.held.free()
        if self.defer_retained:
            pos = ctx.retained_positions if ctx.retained_positions is not None else torch.empty(0, dtype=torch.int64)
            kv = [torch.stack([k, v]) for k, v in ctx.retained]  # per layer [2, n, Hkv, D]
            self.retained = pos, torch.stack(kv, dim=1) if kv else torch.empty(0)
            return
        if ctx.retained_positions is None or ctx.retained_positions.numel() == 0:
            return
        slots = self.held.grow(ctx.retained_positions)
        for layer, (k, v) in enumerate(ctx.retained):
            self.held.write(layer, slots, k, v)

    def release(self) -> None:
        """Give back every block this member holds for the request."""
        self.held.free()
