"""Memory per GPU of an instance: its weight shard, its share of the KV, a batch's activation peak."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Hardware
from .model import ModelShape
from .parallel import Parallelism


class OutOfMemory(ValueError):
    """A plan that does not fit in the GPUs' memory: the simulator refuses it."""


@dataclass(frozen=True)
class MemoryPlan:
    weights: float
    kv: float
    activations: float
    capacity: float  # usable bytes per GPU (memory x utilisation)
    kv_bytes_per_token: float  # per GPU, for one token of context held by the instance

    @property
    def total(self) -> float:
        return self.weights + self.kv + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def kv_capacity_tokens(self) -> int:
        free = self.capacity - self.weights - self.activations
        return max(0, int(free // self.kv_bytes_per_token))

    def as_dict(self) -> dict[str, float]:
        return {"weights": self.weights, "kv": self.kv, "activations": self.activations, "capacity": self.capacity}

    def check(self, what: str = "the plan") -> None:
        if not self.fits:
            gib = 2**30
            raise OutOfMemory(
                f"{what} needs {self.total / gib:.1f} GiB per GPU (weights {self.weights / gib:.1f}, KV "
                f"{self.kv / gib:.1f}, activations {self.activations / gib:.1f}) but has {self.capacity / gib:.1f}"
            )


def memory_plan(
    model: ModelShape, hw: Hardware, par: Parallelism, kv_tokens: int, batch_tokens: int, utilization: float
) -> MemoryPlan:
    b = model.dtype_bytes
    layer_bytes = model.layer_params * b * math.ceil(model.layers / par.pp) / par.tp
    # the embedding sits on the first stage, the LM head on the last; one stage holds both only without PP
    embed = model.vocab * model.hidden * b / par.tp * (2 if par.pp == 1 and not model.tied_embeddings else 1)
    weights = layer_bytes + embed
    kv_shards = min(par.tp, model.kv_heads)  # KV heads beyond TP's reach are replicated, not split
    kv_per_token = model.kv_bytes_per_token / (kv_shards * par.pp * par.sp * par.kvp)
    per_rank = math.ceil(batch_tokens / par.sp)
    inter = math.ceil(model.intermediate / par.tp)
    act = per_rank * b * (4 * model.hidden + 3 * inter + (model.heads + 2 * model.kv_heads) * model.head_dim / par.tp)
    act += min(batch_tokens, 1) * model.vocab / par.tp * 4  # fp32 logits of the sampled row
    return MemoryPlan(weights, kv_tokens * kv_per_token, act, hw.mem_bytes * utilization, kv_per_token)
