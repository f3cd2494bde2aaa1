"""Spindle's scheduling policy: a pure core (cluster state, strategies, actions); `spindle_scheduler` runs it."""

from . import strategies  # noqa: F401
from .actions import Action, Admit, FailRequest, Reject, RunPrefill
from .core import SchedulerConfig, SchedulerCore
from .state import ClusterState, Phase
from .strategy import Strategy, available_strategies, create_strategy, register_strategy

__all__ = [
    "Action",
    "Admit",
    "ClusterState",
    "FailRequest",
    "Phase",
    "Reject",
    "RunPrefill",
    "SchedulerConfig",
    "SchedulerCore",
    "Strategy",
    "available_strategies",
    "create_strategy",
    "register_strategy",
]
