"""A tensor-parallel engine as SPMD lockstep: one leader `Engine` that mirrors its calls, followers that replay.

Every rank runs an `Engine` on its shard of the model (`LlamaModel(tp_group=RankGroup)`) with the same
configuration and the same KV capacity in tokens, so identical call sequences make the schedulers pick
identical batches and the all-reduces line up. `TPLeaderEngine` is an `Engine` whose mutating calls are
recorded; its `step()` first sends the followers the calls since the last step (control.py), then steps.
KV comes in one of two ways. Whole (every KV head, what one engine would hold: a parked or preempted request
pulled from the kvstore): the leader keeps its heads and sends each follower its own slice with the mirrored
`resume`. Direct (`receive_direct`, then `resume` with the leader's heads only): each prefill holder sends each
rank its heads itself, the followers post their receives when the mirrored `ReceiveKV` arrives and put the
parts in place at the mirrored `Resume` (direct.py). `TPFollower.serve()` applies each message and steps.

A peer that dies or stops answering ends the step with `TPError` after `timeout_s` (or at once when its
connection closes): the leader's engine thread stops and the service fails its requests.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path

from torch import Tensor

from spindle_attention.distributed.comm import RankGroup
from spindle_model import LlamaModel, ModelConfig, load_state_dict, resolve_model
from spindle_model.parallel import TPShard

from ..config import EngineConfig
from ..engine import Engine, PreemptedSequence, StepOutput
from ..kv_cache import KVCache
from ..reshard.host_kv import HostKV
from ..reshard.tier import TierPut, open_kv, pull_kv, push_kv
from ..sampling_params import SamplingParams
from ..sp.kv_parts import decode_heads, split_for_decode
from .control import (
    CHECKED_ACK_WORDS,
    Abort,
    AddRequest,
    Call,
    CancelReservation,
    Control,
    Park,
    ReceiveKV,
    Reserve,
    Resume,
    TPError,
    checksum,
    recv_acks,
    recv_control,
    send_ack,
    send_control,
)
from .direct import DirectReceives, Receiver

log = logging.getLogger("spindle.engine.tp")

STEP_TIMEOUT_S = 60.0  # longest wait for a peer within a step (a control message, an ack)
KEEPALIVE_S = 1.0  # an idle leader still sends an empty message this often (followers notice its death)
LEADER_SILENCE_S = 120.0  # a follower that hears nothing for this long gives up
DIRECT_WAIT_S = 30.0  # a direct resume's parts: the leader's arrived last, so the followers' are in (or dead)
STARTUP_TIMEOUT_S = 600.0  # the first exchange waits for the followers to load the model


def tp_engine_config(config: EngineConfig, model_config: ModelConfig, tp_size: int) -> EngineConfig:
    """`config` with the KV capacity fixed in tokens, the same on every rank: what the leader's heads (the
    most of any rank) fit into `kv_cache_memory_gb`, unless `kv_cache_tokens` is given."""
    heads = TPShard.create(model_config, 0, tp_size).num_kv_heads  # ValueError for a size the model cannot split
    if config.kv_cache_tokens is not None:
        return config
    per_token = KVCache.bytes_per_token(model_config.num_layers, heads, model_config.head_dim, config.torch_dtype)
    return replace(config, kv_cache_tokens=config.kv_tokens(per_token))


def load_tp_model(config: EngineConfig, group: RankGroup) -> LlamaModel:
    """This rank's shard of `config.model` (dist must be initialised: the group names global ranks)."""
    source = resolve_model(config.model)
    model = LlamaModel(source.config, dtype=config.torch_dtype, tp_group=group)
    model.load_weights(load_state_dict(source.path, dtype=config.torch_dtype))
    return model


class TPLeaderEngine(Engine):
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        group: RankGroup,
        *,
        timeout_s: float = STEP_TIMEOUT_S,
        keepalive_s: float = KEEPALIVE_S,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        super().__init__(tp_engine_config(config, model.config, len(group.ranks)), model=model)
        if model.shard.rank != 0 or model.shard.world != len(group.ranks):
            raise ValueError(f"the leader must be the first rank of its group {group.ranks}")
        self.group = group
        self.followers = group.ranks[1:]
        self.heads = decode_heads(model.config, len(group.ranks))
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self.follower_blocks_used = [0] * len(self.followers)
        self.follower_direct_bytes = [0] * len(self.followers)  # KV bytes each follower received from holders
        self.direct_bytes = 0  # KV bytes this rank received from holders (its heads only)
        self.forwarded_bytes = 0  # KV bytes this rank sent followers (whole KV imports: parked, preempted)
        self._direct: set[str] = set()  # requests whose KV the ranks receive from the holders
        self._calls: list[Call] = []
        self._kv: list[list[Tensor]] = [[] for _ in self.followers]
        self._seq = 0
        self._last_sent = 0.0
        self._closed = False
        self._exchange(step=False, timeout_s=startup_timeout_s)  # handshake: followers up and sized like us

    @property
    def tp_size(self) -> int:
        return len(self.group.ranks)

    def import_kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """The shape of the KV `resume` takes: every KV head, as one engine would hold it."""
        c = self.model_config
        return (2, len(self.model.layers), num_tokens, c.num_kv_heads, c.head_dim)

    def receive_direct(self, request_id: str, src: int, tags: list[int], runs: list[list[int]]) -> None:
        """Have every follower post a receive of its heads for positions `runs` from holder `src` under
        `tags[its tp rank]` (this rank receives under `tags[0]` itself); the request's `resume` then takes this
        rank's heads only. Call once per holder, after `reserve`."""
        if request_id not in self.reserved:
            raise ValueError(f"request {request_id!r} has no reservation")
        if len(tags) != self.tp_size:
            raise ValueError(f"{len(tags)} tags for {self.tp_size} ranks")
        self._direct.add(request_id)
        self._calls.append(ReceiveKV(request_id, src, list(tags), [list(r) for r in runs]))

    # ---- mirrored calls ----

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prefill_only: bool = False
    ) -> None:
        super().add_request(request_id, prompt_token_ids, params, prefill_only=prefill_only)
        self._calls.append(AddRequest(request_id, list(prompt_token_ids), params, prefill_only))

    def reserve(self, request_id: str, num_tokens: int, choices: int = 1) -> bool:
        ok = super().reserve(request_id, num_tokens, choices)
        if ok:
            self._calls.append(Reserve(request_id, num_tokens, choices))
        return ok

    def cancel_reservation(self, request_id: str) -> bool:
        done = super().cancel_reservation(request_id)
        self._direct.discard(request_id)
        if done:
            self._calls.append(CancelReservation(request_id))
        return done

    def resume(
        self, request_id: str, token_ids: list[int], num_prompt_tokens: int, kv: Tensor, params: SamplingParams
    ) -> None:
        if request_id in self._direct:  # the followers received their heads from the holders
            super().resume(request_id, token_ids, num_prompt_tokens, kv, params)
            self._direct.discard(request_id)
            self._calls.append(Resume(request_id, list(token_ids), num_prompt_tokens, params, direct=True))
            self.direct_bytes += kv.numel() * kv.element_size()
            return
        shape = self.import_kv_shape(len(token_ids) - 1)
        if tuple(kv.shape) != shape:
            raise ValueError(f"KV shape {tuple(kv.shape)} does not match {shape} (every KV head)")
        parts = split_for_decode(kv, self.heads)
        super().resume(request_id, token_ids, num_prompt_tokens, parts[0], params)
        self._calls.append(Resume(request_id, list(token_ids), num_prompt_tokens, params))
        for f, part in enumerate(parts[1:]):
            self._kv[f].append(part)
            self.forwarded_bytes += part.numel() * part.element_size()

    def resume_from_tier(
        self,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
        tier: Path,
        put: TierPut,
    ) -> None:
        """`resume` with every rank reading its own heads from the host-tier file `put.name` in directory `tier`
        (Seesaw's onboarding: the followers read theirs at the next exchange)."""
        store = open_kv(tier, put.name, self.model_config, put.capacity, self.cache.k.dtype, create=False)
        kv = pull_kv(store, self.model.shard.kv_heads, len(token_ids) - 1)
        super().resume(request_id, token_ids, num_prompt_tokens, kv, params)
        self._calls.append(Resume(request_id, list(token_ids), num_prompt_tokens, params, tier=put))

    def park_to_tier(self, request_id: str, tier: Path, put: TierPut) -> PreemptedSequence:
        """Take a decoding request out, every rank writing its heads of the KV to the host-tier file `put.name`
        (the followers at the next exchange: `sync` before reading the file). Returns what it needs to resume (its
        `kv` this rank's heads)."""
        out = Engine.preempt_out(self, request_id)
        store = open_kv(tier, put.name, self.model_config, put.capacity, self.cache.k.dtype, create=False)
        if out.num_kv_tokens > put.capacity:
            raise ValueError(f"{request_id}: {out.num_kv_tokens} KV tokens for a tier file of {put.capacity}")
        push_kv(store, out.kv, self.model.shard.kv_heads)
        self._calls.append(Park(request_id, put))
        return out

    def needs_sync(self) -> bool:
        """Calls wait for the followers, or the keepalive is due."""
        return bool(self._calls) or time.monotonic() - self._last_sent >= self.keepalive_s

    def sync(self) -> None:
        """Send the followers the calls since the last exchange and wait for them to apply them (no step)."""
        self._exchange(step=False)

    def abort(self, request_id: str) -> bool:
        done = super().abort(request_id)
        self._direct.discard(request_id)
        if done:
            self._calls.append(Abort(request_id))
        return done

    def preempt_out(self, request_id: str, *, keep_blocks: bool = False) -> PreemptedSequence:
        raise ValueError("a tensor-parallel engine cannot preempt to outside (its KV is head-sharded)")

    def readmit(self, request_id: str) -> None:
        raise ValueError("a tensor-parallel engine cannot preempt to outside (its KV is head-sharded)")

    # ---- stepping ----

    def has_unfinished(self) -> bool:
        due = time.monotonic() - self._last_sent >= self.keepalive_s
        return bool(self._calls) or due or super().has_unfinished()

    def step(self) -> list[StepOutput]:
        return self._exchange(step=super().has_unfinished())

    def _exchange(self, step: bool, timeout_s: float | None = None) -> list[StepOutput]:
        timeout_s = timeout_s or self.timeout_s
        if self._closed:
            raise TPError("the tensor-parallel group is closed")
        control = Control(self._seq, self._calls, step)
        kv, self._calls, self._kv = self._kv, [], [[] for _ in self.followers]
        self._seq += 1
        self._last_sent = time.monotonic()
        send_control(control, kv, self.followers, timeout_s)
        outputs = super().step() if step else []
        acks = recv_acks(self.followers, timeout_s)
        expected = [control.seq, self.allocator.num_used, self.allocator.num_blocks, checksum(outputs)]
        for peer, ack in zip(self.followers, acks, strict=True):
            if ack[:CHECKED_ACK_WORDS] != expected:
                raise TPError(f"rank {peer} diverged: ack {ack}, leader {expected} (seq, used, blocks, checksum)")
        self.follower_blocks_used = [a[1] for a in acks]
        self.follower_direct_bytes = [a[CHECKED_ACK_WORDS] for a in acks]
        return outputs

    def close(self) -> None:
        """Tell the followers to exit (best effort); the engine takes no further steps."""
        if self._closed:
            return
        self._closed = True
        try:
            send_control(Control(self._seq, [], False, stop=True), [[] for _ in self.followers], self.followers, 5.0)
        except TPError as e:
            log.warning("could not stop the followers: %s", e)


class TPFollower:
    """Replays the leader's calls on this rank's engine and steps with it, until told to stop.

    `receiver` receives the KV parts the holders send this rank directly (`ReceiveKV`); without one, such a call
    is an error."""

    def __init__(
        self,
        engine: Engine,
        leader: int,
        *,
        timeout_s: float = LEADER_SILENCE_S,
        receiver: Receiver | None = None,
        direct_timeout_s: float = DIRECT_WAIT_S,
        tier: Path | None = None,
    ) -> None:
        """`tier`: the group's host-tier directory, for `Park` and tier `Resume` calls (Seesaw)."""
        self.engine = engine
        self.tier = tier
        self.leader = leader
        self.timeout_s = timeout_s
        self.tp_rank = engine.model.shard.rank
        self.direct = None if receiver is None else DirectReceives(receiver, engine.kv_shape, engine.cache.k.dtype)
        self.direct_timeout_s = direct_timeout_s

    def serve(self) -> None:
        e = self.engine
        expected_seq = 0
        while True:
            timeout = self.timeout_s if expected_seq else STARTUP_TIMEOUT_S
            control, parts = recv_control(self.leader, e.kv_shape, e.cache.k.dtype, timeout)
            if control.stop:
                log.info("the leader stopped the group")
                return
            if control.seq != expected_seq:
                raise TPError(f"control message {control.seq} arrived, expected {expected_seq}")
            expected_seq += 1
            self.apply(control.calls, parts)
            outputs = e.step() if control.step else []
            direct = 0 if self.direct is None else self.direct.bytes
            ack = [control.seq, e.allocator.num_used, e.allocator.num_blocks, checksum(outputs), direct]
            send_ack(ack, self.leader, STEP_TIMEOUT_S)

    def apply(self, calls: list[Call], parts: list[Tensor]) -> None:
        e, kv = self.engine, iter(parts)
        for call in calls:
            match call:
                case AddRequest():
                    e.add_request(call.request_id, call.prompt_token_ids, call.params, prefill_only=call.prefill_only)
                case Reserve():
                    if not e.reserve(call.request_id, call.num_tokens, call.choices):
                        raise TPError(f"reserve({call.request_id}) failed here but not on the leader")
                case CancelReservation():
                    e.cancel_reservation(call.request_id)
                    self._drop(call.request_id)
                case ReceiveKV():
                    if self.direct is None:
                        raise TPError("the leader sent a direct KV receive, but this follower cannot receive one")
                    self.direct.post(call.request_id, call.src, call.tags[self.tp_rank], call.runs)
                case Resume():
                    if call.tier is not None:
                        part = pull_kv(self._tier_file(call.tier), e.model.shard.kv_heads, len(call.token_ids) - 1)
                    else:
                        part = self._direct_kv(call) if call.direct else next(kv)
                    e.resume(call.request_id, call.token_ids, call.num_prompt_tokens, part, call.params)
                case Park():
                    out = e.preempt_out(call.request_id)
                    push_kv(self._tier_file(call.put), out.kv, e.model.shard.kv_heads)
                case Abort():
                    e.abort(call.request_id)
                    self._drop(call.request_id)

    def _tier_file(self, put: TierPut) -> HostKV:
        if self.tier is None:
            raise TPError("the leader named a host-tier file, but this follower has no tier")
        try:
            return open_kv(self.tier, put.name, self.engine.model_config, put.capacity, self.engine.cache.k.dtype,
                           create=False)  # fmt: skip
        except (ValueError, OSError) as e:
            raise TPError(f"host-tier file {put.name!r}: {e}") from e

    def _direct_kv(self, call: Resume) -> Tensor:
        if self.direct is None:
            raise TPError(f"a direct resume of {call.request_id} reached a follower that cannot receive one")
        try:
            return self.direct.take(call.request_id, len(call.token_ids) - 1, self.direct_timeout_s)
        except (FutureTimeout, TimeoutError) as e:
            raise TPError(f"the KV of {call.request_id} from its holders did not arrive here in time") from e
        except Exception as e:  # a holder's transfer failed after the leader's own part arrived: we cannot go on
            raise TPError(f"the KV of {call.request_id} from its holders failed here: {e}") from e

    def _drop(self, request_id: str) -> None:
        if self.direct is not None:
            self.direct.drop(request_id)


def follower_engine(config: EngineConfig, group: RankGroup) -> Engine:
    """A follower rank's engine on the real model, sized like its leader's."""
    model = load_tp_model(config, group)
    return Engine(tp_engine_config(config, model.config, len(group.ranks)), model=model)


def leader_engine(config: EngineConfig, group: RankGroup, **kwargs: float) -> TPLeaderEngine:
    return TPLeaderEngine(config, load_tp_model(config, group), group, **kwargs)
