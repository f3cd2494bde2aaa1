"""A tensor-parallel engine as SPMD lockstep: one leader `Engine` that mirrors its calls, followers that replay.

Every rank runs an `Engine` on its shard of the model (`LlamaModel(tp_group=RankGroup)`) with the same
configuration and the same KV capacity in tokens, so identical call sequences make the schedulers pick
identical batches and the all-reduces line up. `TPLeaderEngine` is an `Engine` whose mutating calls are
recorded; its `step()` first sends the followers the calls since the last step (control.py), then steps.
KV comes in one of two ways. Whole (every KV head, what one engine would hold: a parked or preempted request
pulled from the kvstore): the leader keeps its heads and sends each follower its own slice with the mirrored
`resume`. Direct (`receive_direct`, then `resume` with the leader's heads only): each prefill holder sends each
rank its heads itself, the followers post their receives when the mirrored `ReceiveKV` arrives and put the
parts in place at the mirrored `Resume` (direct.py). `TPFollower.serve()` (follower.py) applies each message
and steps.

A peer that dies or stops answering ends the step with `TPError` after `timeout_s` (or at once when its
connection closes): the leader's engine thread stops and the service fails its requests.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from torch import Tensor

from spindle_attention.distributed.comm import RankGroup
from spindle_model import LlamaModel, ModelConfig, load_state_dict, resolve_model
from spindle_model.parallel import TPShard

from ..config import EngineConfig
from ..engine import Engine, PreemptedSequence, StepOutput
from ..kv_cache import KVCache
from ..reshard.tier import Prefetcher, TierPut, open_kv, push_kv
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
    Prefetch,
    ReceiveKV,
    Reserve,
    Resume,
    TPError,
    checksum,
    recv_acks,
    send_control,
)

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
    model = LlamaModel(source.config, dtype=config.torch_dtype, tp_group=group, device=config.torch_device)
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
        self.prefetcher: Prefetcher | None = None  # Seesaw's onboarding from a host tier
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
        (Seesaw's onboarding: the followers read theirs at the next exchange), or taking what `prefetch_from_tier`
        read."""
        kv = self._prefetcher(tier).take(request_id, put, self.timeout_s)
        super().resume(request_id, token_ids, num_prompt_tokens, kv, params)
        self._calls.append(Resume(request_id, list(token_ids), num_prompt_tokens, params, tier=put))

    def prefetch_from_tier(self, request_id: str, tier: Path, put: TierPut) -> Future[Tensor]:
        """Start every rank reading its heads of `put.tokens` tokens from the host-tier file on its prefetcher's
        thread (the followers from the next exchange); the returned future is this rank's read."""
        self._calls.append(Prefetch(request_id, put))
        return self._prefetcher(tier).start(request_id, put)

    def _prefetcher(self, tier: Path) -> Prefetcher:
        if self.prefetcher is None:
            self.prefetcher = Prefetcher(tier, self.model_config, self.cache.k.dtype, self.model.shard.kv_heads)
        return self.prefetcher

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
        prefetched = self.prefetcher is not None and self.prefetcher.drop(request_id)
        if done or prefetched:
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
        if self.prefetcher is not None:
            self.prefetcher.close()
        try:
            send_control(Control(self._seq, [], False, stop=True), [[] for _ in self.followers], self.followers, 5.0)
        except TPError as e:
            log.warning("could not stop the followers: %s", e)


def leader_engine(config: EngineConfig, group: RankGroup, **kwargs: float) -> TPLeaderEngine:
    return TPLeaderEngine(config, load_tp_model(config, group), group, **kwargs)
