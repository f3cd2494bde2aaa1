"""A KVP decode group as one engine: a leader that places requests and mirrors its calls, followers that replay.

Every member (a process at its own global rank) runs a `KVPMember` over the same `KVPPlan`. The leader
(member 0) is what the decode service drives, through the `Engine` calls it uses (reserve, resume, abort,
step, ...): `KVPLeaderEngine`. It decides every placement with a `GroupPlanner` (group.py): at `reserve` the
ranges and master of a request, before each step the scale-ups. KV arrives whole (every token, every KV
head); the leader keeps its range and sends each follower only its own with the mirrored `Place`. Before
each step the followers get the calls since the last one (wire.py), then all members step together; each
step yields every request's token on every member (the masters tell all), so the leader streams them all.
`KVPFollower.serve()` (follower.py) replays and steps until told to stop.

A follower that dies (its process ends, closing its connections) does not end the group. Every member skips it
from the moment it notices (wire.py), so the step ends on the others; the leader learns of it from its own step,
a failed control message or ack, or the lost-member mask in the followers' acks, and then: fails the requests it
mastered or held KV of (`take_failures`: the service ends them with an error), skips their tokens of that step,
re-places reservations that used it, shrinks the group's blocks and puts `Gone(m)` first in the next control
message, so every survivor drops the same requests before the next step. The other requests go on, exact.
A member that stops answering while connected ends in a gloo timeout, which closes every connection of the
waiting process: that, and the leader's own death, still ends the whole group with `KVPError` (the service then
fails every request it holds).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from torch import Tensor

from spindle_model import LlamaModel, ModelConfig, load_state_dict, resolve_model

from ..config import EngineConfig
from ..engine import PreemptedSequence, StepOutput
from ..grammar import GrammarCompiler
from ..kv_cache import KVCache
from ..sampling_params import SamplingParams
from ..sequence import Sequence, stop_reason
from .decoder import KVPMember
from .group import GroupConfig, GroupPlanner, MemberLoad
from .plan import KVPRequest
from .wire import (
    Call,
    Control,
    Drop,
    Gone,
    KVPError,
    Place,
    ScaleDown,
    ScaleUp,
    checksum,
    mask_members,
    recv_acks,
    send_control,
)

log = logging.getLogger("spindle.engine.kvp")

STEP_TIMEOUT_S = 60.0  # longest wait for a peer within a step (a control message, a layer's exchange, an ack)
KEEPALIVE_S = 1.0  # an idle leader still sends an empty message this often (followers notice its death)
LEADER_SILENCE_S = 120.0  # a follower that hears nothing for this long gives up
STARTUP_TIMEOUT_S = 600.0  # the first exchange waits for the followers to load the model


def member_blocks(config: EngineConfig, model_config: ModelConfig) -> int:
    """KV blocks of one member: `kv_cache_tokens`, or what fits into `kv_cache_memory_gb`."""
    per_token = KVCache.bytes_per_token(
        model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, config.torch_dtype
    )
    tokens = config.kv_tokens(per_token)
    if tokens < config.block_size:
        raise ValueError(f"a KVP member needs at least one {config.block_size}-token block, got {tokens} tokens")
    return tokens // config.block_size


def load_member(config: EngineConfig, member: int, ranks: dict[int, int], timeout_s: float) -> KVPMember:
    source = resolve_model(config.model)
    model = LlamaModel(source.config, dtype=config.torch_dtype, device=config.torch_device)
    model.load_weights(load_state_dict(source.path, dtype=config.torch_dtype))
    return KVPMember(
        model, member, ranks, num_blocks=member_blocks(config, source.config), block_size=config.block_size,
        eos_token_ids=source.config.eos_token_ids, max_model_len=config.max_model_len, seed=config.seed,
        timeout_s=timeout_s, survive_loss=True,
        grammars=GrammarCompiler.for_model_dir(source.path, source.config.vocab_size, source.config.eos_token_ids),
    )  # fmt: skip


@dataclass
class _Allocator:
    """What the service reads of an engine's allocator, for the whole group (reservations count as used)."""

    planner: GroupPlanner

    @property
    def num_blocks(self) -> int:
        return self.planner.num_blocks

    @property
    def num_used(self) -> int:
        return self.planner.num_used


class KVPLeaderEngine:
    """Member 0 of a KVP group, with the `Engine` calls a decode service makes (prefilled requests only)."""

    def __init__(
        self,
        config: EngineConfig,
        member: KVPMember,
        *,
        kvp_tokens: int = 0,
        scale_down_tokens: int = 0,
        timeout_s: float = STEP_TIMEOUT_S,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        if member.me != 0 or sorted(member.ranks) != list(range(len(member.ranks))):
            raise ValueError(f"the leader is member 0 of members 0..K-1, got {member.me} of {sorted(member.ranks)}")
        self.config = config
        self.member = member
        self.model_config = member.model.config
        self.max_model_len = member.max_model_len
        self.eos_token_ids = set(member.eos_token_ids)
        self.cache = member.shard.cache
        group = GroupConfig(
            len(member.ranks), member.shard.allocator.num_blocks, member.shard.block_size, kvp_tokens,
            scale_down_tokens,
        )  # fmt: skip
        self.planner = GroupPlanner(group, member.plan)
        self.allocator = _Allocator(self.planner)
        self.followers = {m: r for m, r in member.ranks.items() if m != 0}
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self.requests: dict[str, Sequence] = {}  # every decoding request of the group, as its master samples it
        self.member_blocks_used = dict.fromkeys(self.followers, 0)  # from the last acks
        self.failures: list[tuple[str, str]] = []  # requests dropped (no block, a dead member); the service fails them
        self.dropped = 0  # how many dropped for want of blocks, in all
        self.gone: set[int] = set()  # followers found dead and removed from the group
        self.lost_requests = 0  # requests failed because a member holding, mastering or reserved for them died
        self._calls: list[Call] = []
        self._kv: dict[int, list[Tensor]] = {m: [] for m in self.followers}
        self._seq = 0
        self._last_sent = 0.0
        self._connected = False
        self._closed = False
        self.member_loads: dict[int, MemberLoad] = {}
        self.placed_as_given = 0  # reservations at the scheduler's placement
        self.placed_by_group = 0  # reservations the group's planner placed (none given, or it did not fit)
        self._reported: dict[str, tuple] = {}  # request -> (master, range starts) last given by placement_changes
        self._refresh_loads()

    @property
    def kvp_size(self) -> int:
        return len(self.member.ranks)

    @property
    def scale_ups(self) -> int:
        return self.planner.scale_up_count

    @property
    def scale_downs(self) -> int:
        return self.planner.scale_down_count

    def connect(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """The first exchange: waits for every follower to be up (the data plane must be joined)."""
        self._exchange(step=False, timeout_s=timeout_s)
        self._connected = True

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The KV a request arrives with: every token and KV head, as one engine would hold it."""
        c = self.model_config
        return (2, len(self.member.model.layers), num_tokens, c.num_kv_heads, c.head_dim)

    import_kv_shape = kv_shape

    # ---- what the decode service calls ----

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        if not prompt_token_ids or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"token ids must be a non-empty list of integers in [0, {vocab})")

    def reserve(
        self,
        request_id: str,
        num_tokens: int,
        shards: list[tuple[int, int, int]] | None = None,
        max_tokens: int = 0,
    ) -> bool:
        """Hold blocks for a request's KV: at the scheduler's `shards` (member, start, end) when given and they fit
        now, else where the group's planner puts it (Medha-style, `kvp_tokens`). With `max_tokens`, its outputs'
        growth counts from now on (the planner refuses a reservation some request could not grow after)."""
        if not 0 < num_tokens < self.max_model_len:
            raise ValueError(f"cannot reserve {num_tokens} tokens (context is {self.max_model_len})")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        given = None
        if shards:
            try:
                given = self.planner.place_given(request_id, num_tokens, shards)
            except ValueError as e:
                log.warning("the scheduler's placement of %s is not usable (%s); the group places it", request_id, e)
            else:
                if given is None:
                    log.info("the scheduler's placement of %s %s does not fit now; the group places it", request_id,
                             shards)  # fmt: skip
        final = min(num_tokens + max(0, max_tokens - 1), self.max_model_len) if max_tokens else 0  # as resume commits
        ok = self.planner.reserve(request_id, num_tokens, given, final)
        if ok:
            self.placed_as_given += given is not None
            self.placed_by_group += given is None
        self._refresh_loads()
        return ok

    def cancel_reservation(self, request_id: str) -> bool:
        cancelled = self.planner.cancel(request_id)
        self._refresh_loads()
        return cancelled

    def _refresh_loads(self) -> None:
        self.member_loads = self.planner.member_loads()  # read by the service's threads: replaced, never mutated

    def add_prefilled(
        self, request_id: str, prompt_token_ids: list[int], first_token: int, kv: Tensor, params: SamplingParams
    ) -> None:
        self.resume(request_id, [*prompt_token_ids, first_token], len(prompt_token_ids), kv, params)

    def resume(
        self, request_id: str, token_ids: list[int], num_prompt_tokens: int, kv: Tensor, params: SamplingParams
    ) -> None:
        """Place a request reserved with `reserve(request_id, len(token_ids) - 1)`: its KV `kv_shape(n)` is cut
        by the reserved ranges; this member keeps its own, each follower gets its own with the `Place` call."""
        n = len(token_ids) - 1
        if tuple(kv.shape) != self.kv_shape(n):
            raise ValueError(f"KV shape {tuple(kv.shape)} does not match {self.kv_shape(n)} for {n} tokens")
        if not 0 < num_prompt_tokens <= n:
            raise ValueError(f"{num_prompt_tokens} prompt tokens do not fit {len(token_ids)} tokens with an output")
        self.validate_prompt(token_ids)
        req = self.planner.take_reservation(request_id, n)
        parts = {r.member: kv[:, :, r.start : r.end].contiguous() for r in req.ranges if r.num_tokens}
        self.member.add_request(
            req, parts.get(0), token_ids=token_ids, num_prompt_tokens=num_prompt_tokens, params=params
        )  # fmt: skip
        self._calls.append(Place.of(req, token_ids, num_prompt_tokens, params))
        for m, part in parts.items():
            if m != 0:
                self._kv[m].append(part)
        seq = Sequence(request_id, list(token_ids), params, num_prompt_tokens=num_prompt_tokens)
        seq.num_computed_tokens = n
        self.requests[request_id] = seq
        samples_left = max(0, params.max_tokens - (len(token_ids) - num_prompt_tokens))
        self.planner.commit(request_id, min(n + samples_left, self.max_model_len))
        self._refresh_loads()
        log.info("placed %s: %s, master %d", request_id, [(r.member, r.start, r.end) for r in req.ranges], req.master)

    def abort(self, request_id: str) -> bool:
        if self.planner.cancel(request_id):
            self._refresh_loads()
            return True
        if request_id not in self.requests:
            return False
        self._drop(request_id)
        self._refresh_loads()
        return True

    def _drop(self, request_id: str) -> None:
        del self.requests[request_id]
        self.planner.forget(request_id)
        self.member.abort(request_id)
        self._calls.append(Drop(request_id))

    def request_scale_down(self, request_id: str, member: int, into: int | None = None) -> bool:
        """A strategy asks `member` to leave `request_id`'s holders (its range merges into `into`, an adjacent
        holder; default the one before it). Applied to the plan now, the KV moves at the next step. False when the
        receiver has no room (nothing changes); ValueError when the plan does not allow it."""
        if request_id not in self.requests:
            raise ValueError(f"request {request_id!r} is not decoding in this group")
        if not self.planner.scale_down_fits(request_id, member, into):
            return False
        self._scale_down(request_id, member, into)
        self._refresh_loads()
        return True

    def _scale_down(self, request_id: str, member: int, into: int | None) -> None:
        gone = self.member.plan.get(request_id).range_of(member)
        receiver = self.member.scale_down(request_id, member, into)
        self._calls.append(ScaleDown(request_id, member, receiver))
        self.planner.scale_down_count += 1
        req = self.member.plan.requests[request_id]
        log.info(
            "scale-down %d: member %d leaves %s, its %s merges into member %d (holders %s)",
            self.planner.scale_down_count, member, request_id, gone, receiver, list(req.holders),
        )  # fmt: skip

    def release(self, request_id: str) -> bool:
        return False  # nothing is ever held for a hand-off here

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **_: object) -> None:
        raise ValueError("a KV-parallel decode group takes prefilled requests only")

    def preempt_out(self, request_id: str, *, keep_blocks: bool = False) -> PreemptedSequence:
        raise ValueError("a KV-parallel decode group cannot preempt to outside (its KV is split over members)")

    def readmit(self, request_id: str) -> None:
        raise ValueError("a KV-parallel decode group cannot preempt to outside (its KV is split over members)")

    def blocks_held(self) -> dict[str, int]:
        """Blocks per request over every member (reservations included)."""
        ids = [*self.requests, *self.planner.reserved]
        return {rid: self.planner.request_blocks(rid) for rid in ids}

    @property
    def num_running(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> int:
        return 0

    def placement_changes(self) -> list[KVPRequest]:
        """The decoding requests placed, or whose master or holders changed (scale-up, scale-down), since the last
        call: what the scheduler is told, as its own view is the placement it asked for (`PlaceKVP`)."""
        for rid in [rid for rid in self._reported if rid not in self.requests]:
            del self._reported[rid]
        changed = []
        for rid in self.requests:
            if (q := self.member.plan.requests.get(rid)) is None:
                continue
            key = (q.master, tuple((r.member, r.start) for r in q.ranges))
            if self._reported.get(rid) != key:
                self._reported[rid] = key
                changed.append(q)
        return changed

    def take_failures(self) -> list[tuple[str, str]]:
        out, self.failures = self.failures, []
        return out

    # ---- stepping ----

    def has_unfinished(self) -> bool:
        if not self._connected or self._closed:
            return False
        due = time.monotonic() - self._last_sent >= self.keepalive_s
        return bool(self._calls) or due or bool(self.requests)

    def step(self) -> list[StepOutput]:
        if self.requests:
            self._plan_growth()
        try:
            return self._exchange(step=bool(self.requests))
        finally:
            self._refresh_loads()

    def _plan_growth(self) -> None:
        for rid, m, into in self.planner.scale_downs():
            self._scale_down(rid, m, into)
        ups = self.planner.scale_ups()
        for rid in ups.stuck:
            msg = f"the KV-parallel group has no free block for the next token of {rid}"
            log.warning(msg)
            self.failures.append((rid, msg))
            self.dropped += 1
            self._drop(rid)
        for rid, m in ups.moves:
            self.member.scale_up(rid, m)
            self._calls.append(ScaleUp(rid, m))
            self.planner.scale_up_count += 1
            req = self.member.plan.requests[rid]
            log.info(
                "scale-up %d: %s's tail moves to member %d at token %d (holders %s)",
                self.planner.scale_up_count, rid, m, req.num_tokens, list(req.holders),
            )  # fmt: skip

    def _exchange(self, step: bool, timeout_s: float | None = None) -> list[StepOutput]:
        timeout_s = timeout_s or self.timeout_s
        if self._closed:
            raise KVPError("the KV-parallel group is closed")
        control = Control(self._seq, self._calls, step)
        kv, self._calls, self._kv = self._kv, [], {m: [] for m in self.followers}
        self._seq += 1
        self._last_sent = time.monotonic()
        lost = self.member.lost
        lost |= send_control(control, kv, self.followers, timeout_s)
        placement = dict(self.member.plan.requests)  # who held and mastered what in this step
        if step:
            try:
                self.member.step()
            except KVPError:
                raise
            except RuntimeError as e:
                raise KVPError(f"a KV-parallel step failed: {e}") from e
        tokens = self.member.last_tokens if step else []
        acks = recv_acks(self.followers, timeout_s, lost)
        for ack in acks.values():
            lost |= mask_members(ack[3]) - {0}
        if lost - self.gone:  # no ack check this step: the survivors drop the same requests before the next
            tokens = self._lose(lost - self.gone, placement, tokens)
            self.member_blocks_used.update((m, ack[1]) for m, ack in acks.items() if m in self.followers)
        else:
            for m, ack in acks.items():
                expected = [control.seq, self.planner.placed_blocks(m), checksum(tokens)]
                if ack[:3] != expected:
                    raise KVPError(f"member {m} diverged: ack {ack}, leader {expected} (seq, used blocks, checksum)")
                self.member_blocks_used[m] = ack[1]
        assert self.member.blocks_used == self.planner.placed_blocks(0), "the leader's blocks left the plan"
        return self._outputs(tokens)

    def _lose(
        self, members: set[int], placement: dict[str, KVPRequest], tokens: list[tuple[str, int, bool]]
    ) -> list[tuple[str, int, bool]]:
        """Followers died this step: fail their requests everywhere, keep the others' tokens (members that heard
        from the dead ones and members that did not may differ on those requests until `Gone` is applied)."""
        if 0 in members:
            raise KVPError("the leader cannot lose itself")
        hit = {rid for rid, q in placement.items() if q.master in members or any(r.member in members for r in q.ranges)}
        hit |= {rid for rid, pair in self.member.moved.items() if members & set(pair)}  # a scale-down's KV in flight
        for rid in sorted(hit):  # first, so that their blocks are free when the dead members' reservations move
            if self.requests.pop(rid, None) is not None:
                self.planner.forget(rid)
                self.lost_requests += 1
                self.failures.append((rid, f"a KV-parallel member holding {rid} died (members {sorted(members)})"))
        for m in sorted(members):
            log.warning("KVP member %d (rank %d) is gone; failing its requests", m, self.member.ranks[m])
            self.gone.add(m)
            self.followers.pop(m, None)
            self._kv.pop(m, None)
            self.member_blocks_used.pop(m, None)
            self.member.remove_member(m)
            self._calls.insert(0, Gone(m))
            for rid in self.planner.mark_dead(m):
                self.lost_requests += 1
                self.failures.append((rid, f"KV-parallel member {m} died and the group has no room for {rid}"))
        return [t for t in tokens if t[0] not in hit]

    def _outputs(self, tokens: list[tuple[str, int, bool]]) -> list[StepOutput]:
        outputs = []
        for rid, token, done in tokens:
            seq = self.requests[rid]
            seq.token_ids.append(token)
            seq.num_computed_tokens += 1
            reason = stop_reason(seq, token, self.eos_token_ids, self.max_model_len)
            if (reason is not None) != done:
                raise KVPError(f"the master of {rid} and the leader disagree on whether it finished")
            if done:
                del self.requests[rid]
                self.planner.forget(rid)
            lp = self.member.last_logprobs.get(rid)
            outputs.append(StepOutput(rid, [token], done, reason, logprobs=None if lp is None else [lp]))
        return outputs

    def close(self) -> None:
        """Tell the followers to exit (best effort); the group takes no further steps."""
        if self._closed:
            return
        self._closed = True
        log.info(
            "KVP group closing: %d scale-ups, %d scale-downs, %d requests dropped for want of blocks",
            self.scale_ups, self.scale_downs, self.dropped,
        )  # fmt: skip
        try:
            send_control(Control(self._seq, [], False, stop=True), {}, self.followers, 5.0)
        except KVPError as e:
            log.warning("could not stop the KVP followers: %s", e)


def leader_engine(
    config: EngineConfig, kvp_size: int, first_rank: int, *, kvp_tokens: int = 0, scale_down_tokens: int = 0
) -> KVPLeaderEngine:
    """Member 0 of a group at global ranks first_rank..first_rank+kvp_size-1 (call `connect()` once joined)."""
    ranks = {m: first_rank + m for m in range(kvp_size)}
    member = load_member(config, 0, ranks, STEP_TIMEOUT_S)
    return KVPLeaderEngine(config, member, kvp_tokens=kvp_tokens, scale_down_tokens=scale_down_tokens)
