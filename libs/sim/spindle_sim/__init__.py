"""Discrete-event cluster simulator running the real scheduler core and strategies on a virtual clock."""

from .cluster import LLAMA3_8B_KV_BYTES_PER_TOKEN, SimConfig
from .executor import SimResult, Simulator, simulate
from .metrics import RequestRecord, SimSummary, Slo, Stats, summarize
from .named_cluster import ClusterShape, ClusterSpec, SimSetup, named_cluster

__all__ = [
    "LLAMA3_8B_KV_BYTES_PER_TOKEN",
    "ClusterShape",
    "ClusterSpec",
    "RequestRecord",
    "SimConfig",
    "SimResult",
    "SimSetup",
    "SimSummary",
    "Simulator",
    "Slo",
    "Stats",
    "named_cluster",
    "simulate",
    "summarize",
]
