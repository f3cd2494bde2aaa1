"""Parallel configurations of one group of processes (`PP2`, `TP4`, `PP2xTP2`) and a re-sharding plan between a
prefill and a decode configuration (`PP2:TP2`), checked against the model at construction."""

from __future__ import annotations

import re
from dataclasses import dataclass

from spindle_model.parallel import shard_range


@dataclass(frozen=True)
class Parallel:
    """`pp` pipeline stages of `tp` tensor-parallel ranks each; rank r is stage r // tp, TP rank r % tp."""

    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        if self.pp < 1 or self.tp < 1:
            raise ValueError(f"pipeline and tensor-parallel sizes must be >= 1, got PP{self.pp} x TP{self.tp}")

    @classmethod
    def parse(cls, text: str) -> Parallel:
        """`PP2`, `TP4`, `PP2xTP2` or `TP2PP2` (either order, `x` optional)."""
        parts = re.fullmatch(r"(?i)\s*((?:PP|TP)\d+)\s*x?\s*((?:PP|TP)\d+)?\s*", text)
        if parts is None:
            raise ValueError(f"a parallel configuration is like PP2, TP4 or PP2xTP2, got {text!r}")
        sizes = {"PP": 1, "TP": 1}
        seen = set()
        for part in filter(None, parts.groups()):
            kind, n = part[:2].upper(), int(part[2:])
            if kind in seen:
                raise ValueError(f"{kind} given twice in {text!r}")
            seen.add(kind)
            sizes[kind] = n
        return cls(pp=sizes["PP"], tp=sizes["TP"])

    @property
    def world(self) -> int:
        return self.pp * self.tp

    def label(self) -> str:
        if self.pp > 1 and self.tp > 1:
            return f"PP{self.pp}xTP{self.tp}"
        return f"PP{self.pp}" if self.pp > 1 else f"TP{self.tp}"

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, TP rank) of a global rank."""
        return divmod(rank, self.tp)

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return tuple(range(stage * self.tp, (stage + 1) * self.tp))

    def layers(self, stage: int, num_layers: int) -> tuple[int, int]:
        return shard_range(num_layers, self.pp, stage)

    def check(self, num_layers: int, num_kv_heads: int) -> None:
        if self.pp > num_layers:
            raise ValueError(f"{self.label()}: {self.pp} pipeline stages for {num_layers} layers")
        if self.tp > num_kv_heads:
            raise ValueError(f"{self.label()}: tensor-parallel size {self.tp} exceeds the model's {num_kv_heads} KV "
                             "heads")  # fmt: skip


@dataclass(frozen=True)
class ReshardPlan:
    """Prefill as `prefill`, decode as `decode`, on the same processes."""

    prefill: Parallel
    decode: Parallel

    def __post_init__(self) -> None:
        if self.prefill.world != self.decode.world:
            raise ValueError(f"{self.prefill.label()} and {self.decode.label()} need the same number of processes "
                             f"({self.prefill.world} vs {self.decode.world}): re-sharding keeps the group")  # fmt: skip
        if self.decode.pp != 1:
            raise ValueError(f"decode runs tensor-parallel (TPc), got {self.decode.label()}")

    @classmethod
    def parse(cls, text: str) -> ReshardPlan:
        """`PPa[xTPb]:TPc`, e.g. `PP2:TP2`."""
        if text.count(":") != 1:
            raise ValueError(f"a re-sharding plan is PREFILL:DECODE, e.g. PP2:TP2, got {text!r}")
        p, d = text.split(":")
        return cls(Parallel.parse(p), Parallel.parse(d))

    @property
    def world(self) -> int:
        return self.prefill.world

    def label(self) -> str:
        return f"{self.prefill.label()}:{self.decode.label()}"

    def check(self, num_layers: int, num_kv_heads: int) -> None:
        self.prefill.check(num_layers, num_kv_heads)
        self.decode.check(num_layers, num_kv_heads)
