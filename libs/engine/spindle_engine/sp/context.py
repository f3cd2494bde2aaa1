"""The attention context of one sequence-parallel chunk on one member.

Per layer: take the history this member holds (after any re-balancing for that layer has landed), run
ring or Ulysses attention over the chunk's group, optionally retain the positions the plan assigns to
this member from the blocks that pass by, then store this member's new K/V in its held entries.
With `csa` (a one-chunk all-to-all plan) the attention is CSPS's sparse CSA over the members' segments: the
first and last layers dense, every other one dropping by the importance the layer before measured.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from spindle_attention import attention_fwd
from spindle_attention.csa import CSALevels
from spindle_attention.distributed import CommStats, KVRetention, RankGroup, ring_attention, ulysses_attention
from spindle_attention.distributed.csa_all_to_all import csa_all_to_all_attention

from .held_kv import HeldKV
from .rebalance import Rebalance


class SPAttentionContext:
    def __init__(
        self,
        held: HeldKV,
        group: RankGroup | None,
        attention: str,
        *,
        first_layer: int,
        num_history: int,
        new_slots: Tensor,
        positions: Tensor,
        rebalance: Rebalance | None = None,
        retain: Tensor | None = None,
        stats: CommStats | None = None,
        csa: tuple[CSALevels, int] | None = None,
    ) -> None:
        if attention not in ("ring", "ulysses"):
            raise ValueError(f"attention must be 'ring' or 'ulysses', got {attention!r}")
        if retain is not None and attention != "ring":
            raise ValueError("KV retention needs ring attention (Ulysses does not circulate KV)")
        if csa is not None and (attention != "ulysses" or group is None or num_history):
            raise ValueError("CSA runs on a group's all-to-all attention over a prompt's first chunk")
        self.held = held
        self.group = group
        self.kind = attention
        self.first_layer = first_layer
        self.num_history = num_history
        self.new_slots = new_slots  # [T] held slots of this member's chunk tokens
        self.positions = positions  # [T] their absolute positions
        self.rebalance = rebalance
        self.retain = retain
        self.stats = stats
        self.retained: list[tuple[Tensor, Tensor]] = []  # per layer: k, v [n, Hkv, D] sorted by position
        self.retained_positions: Tensor | None = None
        self.attention_s = 0.0
        self.csa = csa  # (levels, the model's last layer): CSA instead of plain Ulysses
        self.importance: Tensor | None = None  # CSA: this member's tokens' importance from the layer before

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        li = layer - self.first_layer
        if self.rebalance is not None:
            self.rebalance.land(li, self.held)
        t0 = time.perf_counter()
        hist_k, hist_v = self.held.read(li, 0, self.num_history)
        history = (hist_k, hist_v, self.held.positions[: self.num_history])
        retention = KVRetention(self.retain) if self.retain is not None else None
        if self.group is None:  # a one-member chunk: plain attention over history + chunk
            out = self._local(q, k, v, history)
            if retention is not None:
                retention(k, v, self.positions)
                retention(*history)
        elif self.kind == "ring":
            out, _ = ring_attention(
                q, k, v, self.group, q_positions=self.positions, k_positions=self.positions,
                history=history, retain=retention, stats=self.stats,
            )  # fmt: skip
        elif self.csa is not None:
            levels, last = self.csa
            dense = layer in (self.first_layer, last)
            out, _, self.importance = csa_all_to_all_attention(
                q, k, v, levels, self.group, importance=None if dense else self.importance, measure=True,
                stats=self.stats,
            )  # fmt: skip
        else:
            out, _ = ulysses_attention(
                q, k, v, self.group, q_positions=self.positions, k_positions=self.positions,
                history=history, stats=self.stats,
            )  # fmt: skip
        if retention is not None:
            rk, rv, rpos = retention.result()
            self.retained.append((rk, rv))
            self.retained_positions = rpos
        self.held.write(li, self.new_slots, k, v)
        self.attention_s += time.perf_counter() - t0
        return out

    def _local(self, q: Tensor, k: Tensor, v: Tensor, history: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        hk, hv, hpos = history
        k_all, v_all = torch.cat([hk, k]), torch.cat([hv, v])
        k_pos = torch.cat([hpos, self.positions])
        return attention_fwd(q, k_all, v_all, q_positions=self.positions, k_positions=k_pos, return_lse=True)[0]
