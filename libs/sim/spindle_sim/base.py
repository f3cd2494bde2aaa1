"""State every part of the simulator shares (declared here so each part file reads on its own)."""

from __future__ import annotations

from spindle_policy.actions import RunPrefill
from spindle_policy.core import SchedulerCore
from spindle_policy.latency import LatencyModel

from .cluster import SimConfig, SimDecode, SimInstance
from .events import EventQueue
from .metrics import RequestRecord
from .prices import FittedPrices


class SimBase:
    config: SimConfig
    latency: LatencyModel
    prices: FittedPrices  # what the run charges for work (prices.py)
    step_budget: int  # a colocated instance's per-step token budget (colocated_side.py)
    core: SchedulerCore
    instances: dict[str, SimInstance]
    queue: EventQueue
    records: dict[str, RequestRecord]
    plans: dict[str, RunPrefill]
    _next_chunk: dict[str, int]  # request id -> index of its next chunk to run
    _running: set[str]  # requests with a chunk executing now
    _swapped: set[str]  # preempted requests whose KV is in the kvstore
    _split_masters: set[SimDecode]  # masters whose queue head waits for blocks on another instance
    _freed: set[SimDecode]  # instances with a waiting queue that a request mastered elsewhere freed blocks on
    _tails: dict[str, SimDecode]  # request id -> the holder that takes its new tokens
    _scaled_up: dict[str, SimDecode]  # split request -> the member its outputs went to at join (its tail)
