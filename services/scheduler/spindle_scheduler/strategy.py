"""The strategy plug-in interface and its registry.

A strategy decides *where* work runs; the core (core.py) owns request bookkeeping, admission limits and
failure handling. The same strategy objects run under the NATS executor and, later, the simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from spindle_protocol.messages import RequestSpec

from .actions import Action
from .state import ClusterState

_REGISTRY: dict[str, Callable[[], Strategy]] = {}


class Strategy(ABC):
    name: str = ""

    @abstractmethod
    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        """Place a new request: `[Admit, RunPrefill, ...]` or `[Reject]`. Live instances exist for each role."""

    def on_instance_lost(self, instance_id: str, state: ClusterState, now: float) -> list[Action]:
        """Extra actions when an instance dies (the core already fails the requests it held)."""
        return []


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def wrap(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def create_strategy(name: str) -> Strategy:
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(available_strategies())}")
    return _REGISTRY[name]()
