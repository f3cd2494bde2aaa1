"""The strategy plug-in interface and its registry.

A strategy decides *where* and *how* work runs; the core (core.py) owns request bookkeeping, admission
limits and failure handling. The same strategy objects run under the NATS executor (service.py) and the
simulator (sim/). A strategy is named by a spec, ``NAME`` or ``NAME:key=value,key=value``, whose options
are its constructor's keyword arguments (``fixed-sp:sp=8``).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from spindle_protocol.messages import RequestSpec, WorkerEvent

from .actions import Action
from .latency import LatencyModel
from .merging import kvp_merges
from .moving import move_parked
from .preemption import time_slice_preemptions
from .state import ClusterState

_REGISTRY: dict[str, type[Strategy]] = {}
DECODE_OPTIONS: dict[str, object] = {
    "preempt_after_s": 0.0, "move_parked_after_s": 0.0, "kvp_tokens": 0, "kvp_merge_tokens": 0,
}  # fmt: skip


@dataclass(frozen=True)
class StackTraits:
    """What the launcher needs to know of a strategy to lay out a stack for it (`Strategy.stack_traits`)."""

    colocated: bool = False  # plans onto elastic (colocated) instances, not a prefill/decode split
    per_iteration: bool = False  # plans every iteration of groups of elastic instances (`Strategy.elastic`)
    keeps_kv_in_place: bool = False  # may run on sequence-pipeline instances
    spreads_kv: bool = False  # with its options, one request's KV may sit on several instances at once
    reshards: bool = False  # switches its instances' parallel configuration (needs re-sharding instances)
    needs_latency: bool = False  # needs a latency profile
    stack_gap: str = ""  # why the services cannot run it with these options ("" when they can)


class Strategy(ABC):
    name: str = ""
    needs_latency: bool = False  # plans with predicted times: needs a LatencyModel with a prefill part
    real_stack_gap: str = ""  # why the services cannot run its plans yet ("" when they can)
    takes_decode_options: bool = True  # False: DECODE_OPTIONS do not apply (colocated instances)
    # True: plans onto colocated (elastic) instances that prefill and decode; False: a prefill/decode split.
    # `spindle sim` on a named cluster shapes the GPUs by it.
    colocated: bool = False
    # True: plans per iteration (LoongServe): `plan()` admits without placing, and RunBatch actions from
    # `on_event`/`on_tick` say what each group of colocated instances runs next; the instances report each
    # iteration done (IterationDone). Implies `colocated`.
    elastic: bool = False
    # True: every plan keeps a request's KV on one colocated instance from its first chunk to its last token, so
    # that instance may be a sequence pipeline (`spindle up --spp N`: stages that move no KV)
    keeps_kv_in_place: bool = False
    # True: each colocated instance is a re-sharding group (Seesaw): a named cluster in the simulator gives the latency
    # model its `ReshardModel` and the kvstore a host tier (`named_cluster.with_reshard`)
    reshards: bool = False
    # On a prefill/decode split: the share of a named cluster's GPUs `spindle sim` gives its prefill instances
    prefill_share: float = 0.5
    # On a prefill/decode split: True when a prompt too long for one instance still has a plan (SP prefill groups
    # sized so each member's share fits, its KV split over the decode instances' KV-parallel group); a named cluster
    # in the simulator then serves the pool's context, not one instance's
    splits_context: bool = False
    # How its SP prefill groups exchange (a `spindle_costmodel` SP kind): a named cluster in the simulator prices
    # its groups so (ring for the ring layouts, ulysses for all-to-all)
    sp_kind: str = "ring"
    # a colocated instance's per-step token budget where the strategy plans at arrival (`chunked`): the prompt tokens
    # and decodes one engine step takes (vLLM's max_num_batched_tokens); the launcher's elastic default too
    step_token_budget: int = 2048
    # its deployment knobs for `spindle sim compare --tune` (sim/tuning.py): option -> candidate values, and the
    # shape knobs `prefill_share` (on a prefill/decode split) and `decode_tp` (its decode or colocated instances)
    tuning: ClassVar[dict[str, tuple[object, ...]]] = {}
    # whether a paper configures it (its defaults are that configuration: `NAME@paper` beside the tuned one)
    from_paper: ClassVar[bool] = True

    @classmethod
    def spreads_kv(cls, options: dict[str, object]) -> bool:
        """Whether, with these options, one request's KV may sit on several colocated instances at once (what a
        pipeline instance on the services cannot take part in yet)."""
        return not cls.keeps_kv_in_place

    def __init__(self, latency: LatencyModel | None = None) -> None:
        if self.needs_latency and (latency is None or latency.prefill is None):
            raise ValueError(f"strategy {self.name!r} needs a latency model with prefill coefficients")
        self.latency = latency
        self.set_decode_options()

    def set_decode_options(
        self,
        *,
        preempt_after_s: float = 0.0,
        move_parked_after_s: float = 0.0,
        kvp_tokens: int = 0,
        kvp_merge_tokens: int = 0,
    ) -> None:
        """The decode-side options every disaggregated strategy takes (DECODE_OPTIONS; off by default)."""
        given = {
            "preempt_after_s": preempt_after_s, "move_parked_after_s": move_parked_after_s,
            "kvp_tokens": kvp_tokens, "kvp_merge_tokens": kvp_merge_tokens,
        }  # fmt: skip
        for key, value in given.items():
            if not value >= 0:
                raise ValueError(f"{self.name}: {key} must be >= 0, got {value}")
        self.preempt_after_s = preempt_after_s
        self.move_parked_after_s = move_parked_after_s
        # > 0: a prompt longer than this is split over that many members of a KV-parallel decode group
        self.kvp_tokens = kvp_tokens
        # > 0: a decoding request's shard of fewer prompt tokens merges into the holder before it (merging.py)
        self.kvp_merge_tokens = kvp_merge_tokens

    @abstractmethod
    def plan(self, spec: RequestSpec, state: ClusterState, now: float) -> list[Action]:
        """Place a new request: `[Admit, RunPrefill, ...]` or `[Reject]`. Live instances exist for each role."""

    def on_tick(self, state: ClusterState, now: float) -> list[Action]:
        """Periodic decisions (about every 0.25 s). By default, when enabled: a request parked on a full decode
        instance for `move_parked_after_s` moves to one with room (moving.py); one parked for `preempt_after_s`
        swaps running requests out (time-sliced decode, preemption.py); a KV-parallel shard shorter than
        `kvp_merge_tokens` merges into its neighbour (merging.py)."""
        actions: list[Action] = []
        if self.kvp_merge_tokens > 0:
            actions += kvp_merges(state, now, self.kvp_merge_tokens)
        if self.move_parked_after_s > 0:
            actions += move_parked(state, now, self.move_parked_after_s)
        if self.preempt_after_s > 0:
            moving = {a.request_id for a in actions}
            actions += [
                p for p in time_slice_preemptions(state, now, self.preempt_after_s) if p.request_id not in moving
            ]
        return actions

    def on_event(self, event: WorkerEvent, state: ClusterState, now: float) -> list[Action]:
        """Actions in answer to a worker event (progress, completions), after the core has applied it."""
        return []

    def on_instance_lost(self, instance_id: str, state: ClusterState, now: float) -> list[Action]:
        """Extra actions when an instance dies (the core already fails the requests it held)."""
        return []

    @classmethod
    def stack_gap(cls, options: dict[str, object]) -> str:
        """Why the services cannot run this strategy with these options yet ("" when they can)."""
        return cls.real_stack_gap

    @classmethod
    def stack_traits(cls, options: dict[str, object]) -> StackTraits:
        """Everything the launcher reads of this strategy with these options, in one place."""
        return StackTraits(
            colocated=cls.colocated,
            per_iteration=cls.elastic,
            keeps_kv_in_place=cls.keeps_kv_in_place,
            spreads_kv=cls.spreads_kv(options),
            reshards=cls.reshards,
            needs_latency=cls.needs_latency,
            stack_gap=cls.stack_gap(options),
        )

    def options(self) -> dict[str, object]:
        """The options `describe` names, besides the common ones."""
        return {}

    def describe(self) -> str:
        opts = self.options() | {
            "preempt_after_s": self.preempt_after_s,
            "move_parked_after_s": self.move_parked_after_s,
            "kvp_tokens": self.kvp_tokens,
            "kvp_merge_tokens": self.kvp_merge_tokens,
        }
        text = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in opts.items() if v)
        return f"{self.name}:{text}" if text else self.name


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    def wrap(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def _parse_value(text: str) -> int | float | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


PAPER_VARIANT = "@paper"  # `NAME@paper`: the strategy as its paper configures it (its defaults), in a comparison


def parse_strategy_spec(spec: str) -> tuple[str, dict[str, int | float | str]]:
    """``"fixed-sp:sp=8"`` -> ``("fixed-sp", {"sp": 8})``; a trailing ``@paper`` (a variant's label) is ignored."""
    spec = spec.strip().removesuffix(PAPER_VARIANT)
    name, _, rest = spec.partition(":")
    options: dict[str, int | float | str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"strategy option {item!r} in {spec!r} is not key=value")
        options[key.strip().replace("-", "_")] = _parse_value(value.strip())
    return name.strip(), options


def strategy_options(name: str) -> dict[str, object]:
    """The options a strategy accepts, with their defaults."""
    cls = _REGISTRY[name]
    params = inspect.signature(cls.__init__).parameters
    own = {k: p.default for k, p in params.items() if k not in ("self", "latency") and p.kind is p.KEYWORD_ONLY}
    return own | (DECODE_OPTIONS if cls.takes_decode_options else {})


def strategy_class(spec: str) -> type[Strategy]:
    """The registered class a spec names (its options unchecked)."""
    name, _ = parse_strategy_spec(spec)
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(available_strategies())}")
    return _REGISTRY[name]


def stack_traits(spec: str) -> StackTraits:
    """The launcher's view of the strategy a spec names; an unknown name has none of the traits (the scheduler
    service reports it)."""
    try:
        cls = strategy_class(spec)
    except ValueError:
        return StackTraits()
    return cls.stack_traits(dict(parse_strategy_spec(spec)[1]))


def create_strategy(spec: str, latency: LatencyModel | None = None) -> Strategy:
    name, options = parse_strategy_spec(spec)
    strategy_class(spec)  # a known name
    allowed = strategy_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        have = ", ".join(f"{k}={v}" for k, v in allowed.items()) or "none"
        raise ValueError(f"strategy {name!r} has no option {', '.join(unknown)} (options: {have})")
    decode = {k: v for k, v in options.items() if k in DECODE_OPTIONS}
    strategy = _REGISTRY[name](latency=latency, **{k: v for k, v in options.items() if k not in DECODE_OPTIONS})
    if decode:
        strategy.set_decode_options(**decode)  # type: ignore[arg-type]
    return strategy
