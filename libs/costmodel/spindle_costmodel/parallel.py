"""How one instance's GPUs are split (TP, PP, SP, KVP) and what its collectives cost on the links they span.

GPUs are numbered TP-innermost, then SP, then KVP, then PP: a TP group is consecutive GPUs, an SP group strides
by the TP size, and so on. A group spans nodes when the block of GPUs it lies in is larger than one node, or
when it is said to (`cross_nodes`: an SP or KVP group of instances placed on different nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Link

SP_KINDS = ("ring", "ulysses", "sp-tp")


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1  # tensor parallel: heads and MLP columns split
    pp: int = 1  # pipeline stages: layers split
    # sequence parallel prefill: tokens split (ring passes KV; ulysses swaps heads for tokens by all-to-all; sp-tp,
    # CSPS's SP-TP, all-gathers the hidden states into tensor-parallel attention and reduce-scatters its output)
    sp: int = 1
    kvp: int = 1  # KV-cache parallel decode: each member holds a range of the context
    sp_kind: str = "ring"
    # the SP and KVP groups span nodes, whatever the packing (groups of instances placed on different nodes): their
    # collectives cross the inter-node link (a TP group, inside one instance, never does)
    cross_nodes: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "sp", "kvp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sp_kind not in SP_KINDS:
            raise ValueError(f"sp_kind must be one of {SP_KINDS}, got {self.sp_kind!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.sp * self.kvp

    def block(self, axis: str) -> int:
        """GPUs in the smallest consecutive block that holds one group of `axis`."""
        order = ("tp", "sp", "kvp", "pp")
        if axis not in order:
            raise ValueError(f"unknown axis {axis!r}")
        size = 1
        for name in order[: order.index(axis) + 1]:
            size *= getattr(self, name)
        return size

    def spans_nodes(self, axis: str, gpus_per_node: int) -> bool:
        crosses = self.cross_nodes and axis in ("sp", "kvp")
        return getattr(self, axis) > 1 and (crosses or self.block(axis) > gpus_per_node)

    def label(self) -> str:
        parts = [f"{k.upper()}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("sp", self.sp), ("kvp", self.kvp))]
        text = "-".join(p for p, v in zip(parts, (self.tp, self.pp, self.sp, self.kvp), strict=True) if v > 1)
        return (text or "TP1") + (f"-{self.sp_kind}" if self.sp > 1 and self.sp_kind != "ring" else "")


def allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` on each of n ranks: reduce-scatter then all-gather."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency_s


def allgather_s(nbytes_each: float, n: int, link: Link) -> float:
    """Every rank ends with all n pieces of `nbytes_each`."""
    if n <= 1:
        return 0.0
    return (n - 1) * nbytes_each / link.bandwidth + (n - 1) * link.latency_s


def alltoall_s(nbytes: float, n: int, link: Link) -> float:
    """Each rank sends (n-1)/n of its `nbytes` to the others."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency_s


def hierarchical_allgather_s(nbytes: float, n: int, gpus_per_node: int, intra: Link, inter: Link) -> float:
    """All-gather of `nbytes` in all, a 1/n piece on each of n ranks packed on nodes of `gpus_per_node`: first
    across nodes between ranks of the same local index (each gathers its column's pieces over `inter`), then
    within each node (over `intra`), so only (nodes - 1) / n of the data crosses the slow link per GPU.
    A reduce-scatter takes the same time (the same steps reversed)."""
    if n <= 1:
        return 0.0
    local = min(n, gpus_per_node)
    nodes = -(-n // local)
    piece = nbytes / n
    across = (nodes - 1) * piece / inter.bandwidth + (nodes - 1) * inter.latency_s if nodes > 1 else 0.0
    within = (local - 1) * nodes * piece / intra.bandwidth + (local - 1) * intra.latency_s
    return across + within
