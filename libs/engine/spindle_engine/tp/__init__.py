"""Tensor-parallel engines in SPMD lockstep over a `RankGroup` (lockstep.py; the wire format is control.py)."""

from .control import Control, TPError
from .lockstep import TPFollower, TPLeaderEngine, follower_engine, leader_engine, tp_engine_config

__all__ = [
    "Control",
    "TPError",
    "TPFollower",
    "TPLeaderEngine",
    "follower_engine",
    "leader_engine",
    "tp_engine_config",
]
