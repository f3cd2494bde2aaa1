"""What a re-sharding group's times come from (Seesaw): one colocated instance of N GPUs that runs as one of several
`PPa x TPb` configurations at a time, switching between them by reloading its weights from host memory, with a
host-memory KV tier on the other side of the same links.

- An iteration in configuration `c` takes `c.fit` (the mixed-batch form, `MixedFit`: a full pass of the batch
  through every pipeline stage); the simulator splits it over `c.pp` stages, so iterations that do not wait for
  their samples pipeline (a prefill micro-batch per stage, decodes in `pp` micro-batches).
- A switch loads every GPU's weight shard from host memory (all the weights once, over the group's host links in
  parallel) and moves the KV the instance keeps to the new layout (out to the host tier and back: twice its bytes).
- A swap (out to the tier, or onboarding back) moves a request's KV over the same links.

Built from the cost model (`strategies/seesaw/configs.py: reshard_model`); not part of a latency model's JSON.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .mixed_batch import MixedFit

_LABEL = re.compile(r"^(?:TP(\d+))?(?:PP(\d+))?$")


def parse_label(label: str) -> tuple[int, int]:
    """`TP2PP2` -> (tp 2, pp 2); `PP4` -> (1, 4); `TP1` -> (1, 1)."""
    m = _LABEL.match(label)
    if not label or m is None or not (m.group(1) or m.group(2)):
        raise ValueError(f"not a parallel configuration label (TPb, PPa or TPbPPa): {label!r}")
    tp, pp = int(m.group(1) or 1), int(m.group(2) or 1)
    if tp < 1 or pp < 1:
        raise ValueError(f"TP and PP must be >= 1 in {label!r}")
    return tp, pp


@dataclass(frozen=True)
class GroupConfig:
    """One configuration of the group: its iteration form and the KV it has room for (after its weights)."""

    label: str
    fit: MixedFit
    kv_tokens: int

    def __post_init__(self) -> None:
        parse_label(self.label)
        if self.kv_tokens < 1:
            raise ValueError(f"{self.label}: kv_tokens must be >= 1, got {self.kv_tokens}")

    @property
    def pp(self) -> int:
        return parse_label(self.label)[1]

    def iteration_s(self, chunks: Iterable[tuple[int, int]], num_decodes: int = 0, decode_kv: float = 0) -> float:
        """A full pass (every stage) of `chunks` ((history, length) pairs) and `num_decodes` decodes over
        `decode_kv` cached tokens."""
        return self.fit.predict(chunks, num_decodes, decode_kv)


@dataclass(frozen=True)
class ReshardModel:
    configs: Mapping[str, GroupConfig]
    prefill: str  # c_p: the configuration a prefill phase runs in
    decode: str  # c_d
    weight_bytes: float  # the model's weights, all shards together
    host_bytes_per_s: float  # the group's host links together (each GPU moves its own shard)
    host_latency_s: float = 10e-6
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        for c in (self.prefill, self.decode):
            if c not in self.configs:
                raise ValueError(f"configuration {c!r} is not one of {sorted(self.configs)}")
        if not (self.host_bytes_per_s > 0 and self.weight_bytes >= 0 and self.kv_bytes_per_token >= 0):
            raise ValueError("host_bytes_per_s must be > 0, weight_bytes and kv_bytes_per_token >= 0")

    def config(self, label: str) -> GroupConfig:
        if label not in self.configs:
            raise ValueError(f"no configuration {label!r}; have {', '.join(sorted(self.configs))}")
        return self.configs[label]

    def host_s(self, num_bytes: float) -> float:
        """Seconds to move `num_bytes` between the group's GPUs and host memory."""
        return self.host_latency_s + num_bytes / self.host_bytes_per_s if num_bytes > 0 else 0.0

    def switch_s(self, kept_kv_tokens: int) -> float:
        """A switch: every weight shard loaded, the kept KV out and back in the new layout."""
        return self.host_s(self.weight_bytes + 2 * kept_kv_tokens * self.kv_bytes_per_token)
