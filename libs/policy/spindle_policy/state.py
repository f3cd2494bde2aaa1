"""Cluster state as the scheduler sees it: live instances (from heartbeats) and requests in flight."""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from spindle_protocol.messages import InstanceInfo, RequestSpec

from .actions import KVShard, PrefillChunk, decode_tokens

PREFILL_ROLES = ("prefill", "elastic")  # an elastic instance prefills and decodes
DECODE_ROLES = ("decode", "elastic")


class Phase(enum.Enum):
    PREFILL = "prefill"  # planned onto prefill instances, running or queued there
    TRANSFER = "transfer"  # KV moving to the decode instance (or parked in the kvstore)
    DECODE = "decode"


@dataclass
class InstanceState:
    info: InstanceInfo
    alive: bool = True
    planned_tokens: int = 0  # prompt tokens we sent since its last heartbeat (it has not counted them yet)
    planned_blocks: int = 0  # KV blocks we expect it to take for requests planned onto it (until a heartbeat)
    planned: dict[str, float] = field(default_factory=dict)  # request id -> predicted end of its prefill work here
    planned_until: float = float("-inf")  # max(planned.values()): kept by ClusterState.plan_work / work_done
    # "virtual usage" (Llumnix, Tetris §5.2): blocks of requests placed here for decode that have not started
    # decoding yet (prefilling, in transfer, parked), which the instance's own count does not hold yet
    incoming: dict[str, int] = field(default_factory=dict)
    # Tetris §5.2: slot statistics refreshed on each returned output. Blocks and batch places of requests that
    # finished here since the last heartbeat, which the instance's own count still holds
    released_blocks: int = 0
    released_running: int = 0
    mastering: set[str] = field(default_factory=set)  # requests whose decode it leads (KV-parallel: the master)

    @property
    def id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def free_blocks(self) -> int:
        """Free KV blocks, virtual usage excluded."""
        used = self.info.kv_blocks_used + self.planned_blocks - self.released_blocks
        return self.info.kv_blocks_total - max(0, used) - sum(self.incoming.values())

    @property
    def freeness(self) -> float:
        """Free blocks (virtual usage excluded) per request of its active batch, those on their way included."""
        return self.free_blocks / max(1, self.info.num_running - self.released_running + len(self.incoming))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // (self.info.block_size or 1))

    @property
    def predicted_queue_tokens(self) -> int:
        return self.info.queued_tokens + self.planned_tokens

    def busy_until(self, now: float) -> float:
        """Predicted time this instance finishes the prefill work planned onto it (`now` when idle)."""
        return now if self.planned_until < now else self.planned_until


@dataclass
class RequestState:
    spec: RequestSpec
    phase: Phase
    prefill_instances: tuple[str, ...]
    decode_instance: str
    admitted_at: float
    tokens_done: int = 0  # prompt tokens computed so far (PrefillProgress)
    chunks: tuple[PrefillChunk, ...] = ()  # the prefill plan
    decode_shards: tuple[KVShard, ...] = ()  # KV-parallel decode: the KV split over decode instances
    parked_since: float | None = None  # waiting for blocks on its decode instance, its KV in the kvstore
    decoding_since: float | None = None  # in its decode instance's batch since (DecodeStarted)
    preempting: bool = False  # a Preempt was sent and its Preempted event has not come yet
    moving: bool = False  # a TransferKV was sent and not answered yet
    merging: bool = False  # a ScaleDownKVP was sent and not answered yet
    merge_refused_at: float | None = None  # when the last ScaleDownKVP was refused (no retry for a while)
    num_preemptions: int = 0
    reruns: int = 0  # times its prefill ran again after the instance running it was lost

    def kv_location(self) -> list[tuple[int, int, tuple[str, ...]]]:
        """Where the KV of each computed token range lives now: `(start, end, instances)` (a parked request's
        is listed at its decode instance, which pulls it back from the kvstore)."""
        if self.phase is Phase.DECODE or self.num_preemptions or (self.phase is Phase.TRANSFER and not self.chunks):
            return [(s.start, s.end, (s.instance,)) for s in self.decode_holders()]
        return [(c.start, min(c.end, self.tokens_done), c.instances) for c in self.chunks if c.start < self.tokens_done]

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def parked(self) -> bool:
        return self.parked_since is not None

    def holders(self) -> set[str]:
        """Instances whose loss ends this request."""
        decode = set(self.decode_instances())
        if self.phase is Phase.DECODE or self.num_preemptions:
            return decode
        return {*self.prefill_instances, *decode}

    def decode_holders(self) -> tuple[KVShard, ...]:
        """Each decode instance's shard of the prompt's KV, the master's first (one shard when not split)."""
        return self.decode_shards or (KVShard(self.decode_instance, 0, self.spec.prompt.num_tokens),)

    def decode_instances(self) -> tuple[str, ...]:
        """The decode instances holding its KV: the master first."""
        return tuple(s.instance for s in self.decode_holders())

    def decode_tokens(self) -> dict[str, int]:
        """Tokens each decode instance holds for this request once it decodes (the tail: new tokens too)."""
        return decode_tokens(self.spec, self.decode_holders())


FORGOTTEN_KEPT = 4096  # ids of the latest requests the core forgot (for strategies with per-request state of their own)


@dataclass
class ClusterState:
    instances: dict[str, InstanceState] = field(default_factory=dict)
    requests: dict[str, RequestState] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    _live: dict[tuple[str, ...], list[InstanceState]] = field(default_factory=dict, repr=False)
    # requests the core forgot (ended, failed, aborted, past their deadline), the latest FORGOTTEN_KEPT of them, and
    # how many in all: a strategy that keeps per-request state drops what ended without scanning every request
    forgotten: deque[str] = field(default_factory=lambda: deque(maxlen=FORGOTTEN_KEPT), repr=False)
    forgotten_total: int = 0

    def forget(self, request_id: str) -> RequestState | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.forgotten.append(request_id)
            self.forgotten_total += 1
        return req

    def forgotten_since(self, seen: int) -> list[str] | None:
        """The ids forgotten after the first `seen` of `forgotten_total`, oldest first; None when more of them
        ended than are kept (the caller then checks its requests against `requests` instead)."""
        new = self.forgotten_total - seen
        if new > len(self.forgotten):
            return None
        return list(self.forgotten)[len(self.forgotten) - new :] if new else []

    def live(self, *roles: str) -> list[InstanceState]:
        """Live instances with any of `roles`, in data-plane rank order (a cached list: do not mutate it)."""
        cached = self._live.get(roles)
        if cached is None:
            live = (i for i in self.instances.values() if i.alive and i.role in roles)
            cached = self._live[roles] = sorted(live, key=lambda i: (i.info.rank, i.id))
        return cached

    def mark_dead(self, instance_id: str) -> None:
        self.instances[instance_id].alive = False
        self.dead.add(instance_id)
        self._live.clear()

    def update_instance(self, info: InstanceInfo) -> None:
        current = self.instances.get(info.instance_id)
        if current is None or not current.alive:
            self.instances[info.instance_id] = InstanceState(info)
            self.dead.discard(info.instance_id)
            self._live.clear()
            return
        if info.updated_at >= current.info.updated_at:
            current.info = info
            current.planned_tokens = 0  # the heartbeat now counts what we planned
            current.planned_blocks = 0
            current.released_blocks = current.released_running = 0  # and what finished

    def plan_work(self, instance_ids: tuple[str, ...], request_id: str, until: float) -> None:
        """Record that `instance_ids` are busy with `request_id` until `until` (predicted)."""
        for iid in instance_ids:
            inst = self.instances[iid]
            inst.planned[request_id] = end = max(until, inst.planned.get(request_id, until))
            inst.planned_until = max(inst.planned_until, end)

    def work_done(self, instance_ids: tuple[str, ...], request_id: str) -> None:
        for iid in instance_ids:
            if (inst := self.instances.get(iid)) is not None and inst.planned.pop(request_id, None) is not None:
                inst.planned_until = max(inst.planned.values(), default=float("-inf"))

    def max_model_len(self) -> int:
        lens = [i.info.max_model_len for i in self.instances.values() if i.alive and i.info.max_model_len > 0]
        return min(lens) if lens else 0

    def decoding_on(self, instance_id: str) -> list[RequestState]:
        return [r for r in self.requests.values() if r.phase is Phase.DECODE and r.decode_instance == instance_id]

    def parked_on(self, instance_id: str) -> list[RequestState]:
        """Requests waiting for blocks on `instance_id`, longest-waiting first."""
        parked = [r for r in self.requests.values() if r.parked_since is not None and r.decode_instance == instance_id]
        return sorted(parked, key=lambda r: r.parked_since)  # type: ignore[arg-type,return-value]

    def num_running(self) -> int:
        return sum(1 for r in self.requests.values() if r.phase is Phase.DECODE)

    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if r.phase is not Phase.DECODE)
