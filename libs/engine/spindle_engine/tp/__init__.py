"""Tensor-parallel engines in SPMD lockstep over a `RankGroup` (lockstep.py; the wire format is control.py)."""

from .control import Control, TPError
from .direct import DirectReceives, Receiver, from_runs, slice_bytes, to_runs
from .follower import TPFollower, follower_engine
from .lockstep import TPLeaderEngine, leader_engine, tp_engine_config

__all__ = [
    "Control",
    "DirectReceives",
    "Receiver",
    "TPError",
    "TPFollower",
    "TPLeaderEngine",
    "follower_engine",
    "from_runs",
    "leader_engine",
    "slice_bytes",
    "to_runs",
    "tp_engine_config",
]
