"""Discrete-event cluster simulator running the real scheduler core and strategies on a virtual clock."""

from .cluster import LLAMA3_8B_KV_BYTES_PER_TOKEN, SimConfig
from .executor import SimResult, Simulator, simulate
from .metrics import RequestRecord, SimSummary, Slo, Stats, summarize

__all__ = [
    "LLAMA3_8B_KV_BYTES_PER_TOKEN",
    "RequestRecord",
    "SimConfig",
    "SimResult",
    "SimSummary",
    "Simulator",
    "Slo",
    "Stats",
    "simulate",
    "summarize",
]
