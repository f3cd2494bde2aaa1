"""What a cost query returns: per-op compute, memory and communication seconds, the total, and memory use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OpCost:
    """One op summed over the layers it runs in. `s` is its share of the total after overlap:
    max(compute, memory) + fixed kernel costs for compute ops, the exposed part of `comm_s` for transfers."""

    name: str
    compute_s: float = 0.0
    memory_s: float = 0.0
    comm_s: float = 0.0
    s: float = 0.0
    note: str = ""

    def scaled(self, k: float) -> OpCost:
        return OpCost(self.name, self.compute_s * k, self.memory_s * k, self.comm_s * k, self.s * k, self.note)

    def plus(self, other: OpCost) -> OpCost:
        return OpCost(
            self.name,
            self.compute_s + other.compute_s,
            self.memory_s + other.memory_s,
            self.comm_s + other.comm_s,
            self.s + other.s,
            self.note or other.note,
        )


@dataclass(frozen=True)
class Breakdown:
    """A query's cost. total_s is the latency of the whole operation; stage_s (pipelines) the time one stage
    is busy per iteration, what bounds throughput."""

    what: str
    ops: tuple[OpCost, ...]
    total_s: float
    memory_bytes: dict[str, float] = field(default_factory=dict)
    stage_s: float | None = None

    def op(self, name: str) -> OpCost | None:
        return next((o for o in self.ops if o.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "total_s": self.total_s,
            "stage_s": self.stage_s,
            "ops": [
                {"name": o.name, "compute_s": o.compute_s, "memory_s": o.memory_s, "comm_s": o.comm_s, "s": o.s}
                for o in self.ops
            ],
            "memory_bytes": dict(self.memory_bytes),
        }

    def format_table(self) -> str:
        def ms(x: float) -> str:
            return f"{x * 1e3:11.3f}"

        lines = [self.what, f"{'op':<22}{'compute ms':>11}{'memory ms':>11}{'comm ms':>11}{'time ms':>11}  share"]
        for o in self.ops:
            share = o.s / self.total_s if self.total_s > 0 else 0.0
            lines.append(f"{o.name:<22}{ms(o.compute_s)}{ms(o.memory_s)}{ms(o.comm_s)}{ms(o.s)}  {share:5.1%}")
        lines.append(f"{'total':<22}{'':>33}{ms(self.total_s)}")
        if self.stage_s is not None:
            lines.append(f"{'pipeline stage':<22}{'':>33}{ms(self.stage_s)}")
        if self.memory_bytes:
            mem = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in self.memory_bytes.items())
            lines.append(f"memory per GPU: {mem}")
        return "\n".join(lines)
