"""One member of a KVP decode group: steps the requests it masters and serves the others' queries.

All members of the group run `step()` in lockstep (the same number of times, with the same `add_request`
/ `scale_up` / `scale_down` calls between the same steps). A step appends one token to every active request (at its
tail), runs every layer's exchange (`KVPAttentionContext`), samples the mastered requests' next tokens,
then tells every other member which requests finished (one small int64 message per pair, tag `KVP_TAG`),
so each holder frees its ranges of them.

`scale_down(rid, member)` changes the plan at once on every member (the receiver makes room for the range, the
leaver takes its KV out of its blocks); the KV itself moves at the start of the next step, leaver to receiver,
one message per scale-down (tag `move_tag(i)`), before any attention, so the step sees the merged range.

With `survive_loss` (a lockstep group), a peer found dead during a step joins `lost` and is skipped for the rest
of it (wire.py); the step ends on the others, exact for the requests it had no part in. Between steps the
leader's `Gone` makes every member `remove_member` it: drop every request it mastered or held KV of. Without
it (verify runs) a dead peer raises `KVPError`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from spindle_attention.distributed import p2p
from spindle_model import LlamaModel

from ..grammar import GrammarCompiler
from ..kv_cache import BlockAllocator, KVCache, OutOfBlocksError
from ..sampler import TokenLogprobs, sample
from ..sampling_params import MAX_LOGPROBS, SamplingParams
from ..sequence import Sequence, stop_reason
from .context import KVP_TAG, MAX_MOVES, KVPAttentionContext, KVPStats, move_tag
from .plan import KVPPlan, KVPRequest
from .shard import KVShard
from .wire import post, wait_peers

LEADER_MEMBER = 0  # the member whose engine publishes the group's tokens (lockstep.leader_engine)
LOGPROB_ROW = 3 + 2 * MAX_LOGPROBS  # token, logprob, n, n alternative ids and n logprobs (padded)


def _pack_logprobs(lp: TokenLogprobs) -> Tensor:
    n = len(lp.top_ids)
    row = torch.zeros(LOGPROB_ROW, dtype=torch.float64)
    row[:3] = torch.tensor([lp.token_id, lp.logprob, n], dtype=torch.float64)
    row[3 : 3 + n] = torch.tensor(lp.top_ids, dtype=torch.float64)
    row[3 + MAX_LOGPROBS : 3 + MAX_LOGPROBS + n] = torch.tensor(lp.top_logprobs, dtype=torch.float64)
    return row


def _unpack_logprobs(row: Tensor) -> TokenLogprobs:
    token, logprob, n = int(row[0]), float(row[1]), int(row[2])
    ids = tuple(int(t) for t in row[3 : 3 + n].tolist())
    return TokenLogprobs(token, logprob, ids, tuple(row[3 + MAX_LOGPROBS : 3 + MAX_LOGPROBS + n].tolist()))


@dataclass(frozen=True)
class KVPOutput:
    request_id: str
    token: int
    finished: bool
    finish_reason: str | None
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class _Move:
    """A scale-down's KV, to move at the start of the next step."""

    request_id: str
    leaver: int
    receiver: int
    num_tokens: int
    front: bool  # the range goes before the receiver's own (the leaver held the first range)
    kv: Tensor | None  # on the leaver: the range's KV `[2, layers, n, Hkv, D]`


class KVPMember:
    def __init__(
        self,
        model: LlamaModel,
        member: int,
        ranks: dict[int, int],
        *,
        num_blocks: int,
        block_size: int = 16,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        seed: int = 0,
        keep_logits: bool = False,
        timeout_s: float | None = None,
        survive_loss: bool = False,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        if member not in ranks:
            raise ValueError(f"member {member} is not in the group {sorted(ranks)}")
        if model.shard.world != 1:
            raise ValueError("KVP decode members run without tensor parallelism (TP 1)")
        cfg = model.config
        self.model = model.eval()
        self.me = member
        self.ranks = dict(ranks)
        self.plan = KVPPlan(sorted(ranks))
        cache = KVCache(len(model.layers), num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                        device=model.device)  # fmt: skip
        self.shard = KVShard(cache, BlockAllocator(num_blocks, block_size))
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.generator = torch.Generator().manual_seed(seed)
        self.grammars = grammars  # compiles the grammars of the requests this member masters
        self.seqs: dict[str, Sequence] = {}  # the requests this member masters
        self.stats = KVPStats()
        self.step_stats: list[KVPStats] = []  # one per step, for reports
        self.keep_logits = keep_logits
        self.logits: dict[str, list[Tensor]] = {}
        self.timeout_s = timeout_s  # longest wait for a peer's message within a step; None = forever
        self.survive_loss = survive_loss  # a dead peer is skipped (lockstep.py); otherwise it raises KVPError
        self.lost: set[int] = set()  # members found dead (skipped from then on)
        self.last_tokens: list[tuple[str, int, bool]] = []  # every request's (id, token, finished) of the last step
        self.logprob_requests: dict[str, int] = {}  # every request that wants logprobs -> how many alternatives
        self.last_logprobs: dict[str, TokenLogprobs] = {}  # on the leader (member 0): the last step's, by request
        self.pending: list[_Move] = []  # scale-downs whose KV moves at the start of the next step
        self.moved: dict[str, tuple[int, int]] = {}  # the last step's scale-downs: request -> (leaver, receiver)
        self._token_bytes = KVCache.bytes_per_token(len(model.layers), cfg.num_kv_heads, cfg.head_dim, model.dtype)

    # ---- placement (the same calls on every member) ----

    def add_request(
        self,
        req: KVPRequest,
        kv: Tensor | None = None,
        *,
        token_ids: list[int] | None = None,
        num_prompt_tokens: int | None = None,
        params: SamplingParams | None = None,
    ) -> None:
        """Place `req`. A holder passes the KV of its range `[2, layers, n, Hkv, D]`; the master passes the
        request's tokens (prompt, then outputs so far; the KV of all but the last is placed)."""
        self.plan.add(req)
        if params is not None and params.logprobs is not None:
            self.logprob_requests[req.request_id] = params.logprobs
        try:
            mine = req.range_of(self.me)
            if mine is not None:
                if kv is None or kv.shape[2] != mine.num_tokens:
                    raise ValueError(f"member {self.me} holds {mine} of {req.request_id!r} and needs its KV")
                self.shard.add_range(req.request_id, mine.start, kv)
            if req.master == self.me:
                if token_ids is None or params is None or len(token_ids) != req.num_tokens + 1:
                    raise ValueError(f"the master of {req.request_id!r} needs its {req.num_tokens + 1} token ids")
                n = num_prompt_tokens or req.num_tokens
                self.seqs[req.request_id] = Sequence(req.request_id, list(token_ids), params, num_prompt_tokens=n)
                self.logits[req.request_id] = []
        except Exception:
            self.plan.finish(req.request_id)
            self.shard.free(req.request_id)
            raise

    def scale_up(self, request_id: str, member: int) -> None:
        """`member` becomes the tail of `request_id` from the next step on (existing KV stays put)."""
        req = self.plan.scale_up(request_id, member)
        if member == self.me:
            self.shard.add_range(request_id, req.num_tokens)

    def plan_blocks(self, member: int) -> int:
        """Blocks `member` holds by the plan (every member of a group has this member's block pool)."""
        bs = self.shard.block_size
        return sum(-(-r.num_tokens // bs) for q in self.plan.requests.values() for r in q.ranges if r.member == member)

    def scale_down(self, request_id: str, member: int, into: int | None = None) -> int:
        """`member` leaves `request_id`'s holders; its range merges into an adjacent holder's (plan.py), which is
        returned. Raises ValueError (not allowed) or OutOfBlocksError (no room on the receiver) on every member
        alike, before anything changes. The KV moves at the start of the next step."""
        req = self.plan.get(request_id)
        receiver = req.scale_down_target(member, into)
        gone, kept = req.range_of(member), req.range_of(receiver)
        assert gone is not None and kept is not None
        bs = self.shard.block_size
        extra = -(-(gone.num_tokens + kept.num_tokens) // bs) - -(-kept.num_tokens // bs)
        if self.plan_blocks(receiver) + extra > self.shard.allocator.num_blocks:
            raise OutOfBlocksError(f"member {receiver} has no room for {gone} of {request_id!r}")
        if len(self.pending) >= MAX_MOVES:
            raise ValueError(f"at most {MAX_MOVES} scale-downs per step")
        if receiver == self.me:
            self.shard.make_room(request_id, gone.num_tokens)
        kv = self.shard.take(request_id).cpu() if member == self.me else None
        self.plan.scale_down(request_id, member, receiver)
        self.pending.append(_Move(request_id, member, receiver, gone.num_tokens, gone.start < kept.start, kv))
        return receiver

    # ---- stepping ----

    def has_unfinished(self) -> bool:
        return bool(self.plan.requests)

    @torch.inference_mode()
    def step(self) -> list[KVPOutput]:
        """One decode step of the whole group; returns the tokens of the requests this member masters."""
        self.last_tokens = []
        t0 = time.perf_counter()
        before = KVPStats(**vars(self.stats))
        self._move_kv()
        if not self.plan.requests:
            return []
        tails = [rid for rid, r in self.plan.requests.items() if r.tail == self.me]
        need = sum(self.shard.blocks_to_grow(rid) for rid in tails)
        if need > self.shard.allocator.num_free:  # before changing anything; scale-up should have come first
            raise OutOfBlocksError(f"member {self.me} needs {need} blocks for its tails' next tokens")
        slots = {rid: self.shard.grow(rid) for rid in tails}
        for rid in list(self.plan.requests):
            self.plan.append(rid)
        ctx = KVPAttentionContext(
            self.plan, self.me, self.ranks, self.shard, first_layer=self.model.layer_range[0],
            num_q_heads=self.model.num_local_q_heads, tail_slots=slots, stats=self.stats, timeout_s=self.timeout_s,
            lost=self._lost,
        )  # fmt: skip
        outputs: list[KVPOutput] = []
        if ctx.batch:
            seqs = [self.seqs[r.request_id] for r in ctx.batch]
            ids = torch.tensor([s.token_ids[-1] for s in seqs], device=self.model.device)
            positions = torch.tensor([r.num_tokens - 1 for r in ctx.batch], device=self.model.device)
            hidden = self.model(positions, ctx, input_ids=ids)
            logits = self.model.compute_logits(hidden)
            sampled = sample(logits, seqs, self.generator, self.eos_token_ids, self.grammars)
            for i, (seq, token, lp) in enumerate(zip(seqs, sampled.tokens, sampled.logprobs, strict=True)):
                if self.keep_logits:
                    self.logits[seq.request_id].append(logits[i].clone())
                seq.token_ids.append(token)
                reason = self._stop_reason(seq, token)
                outputs.append(KVPOutput(seq.request_id, token, reason is not None, reason, lp))
            for r in ctx.batch:  # moving the other holders' KV to the master instead of sending q
                remote = sum(x.num_tokens for x in r.ranges if x.member != self.me)
                self.stats.kv_move_bytes += remote * self._token_bytes
        else:
            for layer in self.model.layers:
                ctx.serve_layer(layer.layer_id)
        self._exchange_finished(outputs)
        self.stats.step_s += time.perf_counter() - t0
        self.step_stats.append(KVPStats(**{k: getattr(self.stats, k) - v for k, v in vars(before).items()}))
        return outputs

    def _move_kv(self) -> None:
        """The scale-downs since the last step: each leaver sends its range's KV to the receiver, which merges it.
        A receiver whose leaver died merges nothing (the request is dropped with the leaver's `Gone`)."""
        moves, self.pending, self.moved = self.pending, [], {}
        works, inbox = [], []
        layers, _, _, hkv, d = self.shard.cache.k.shape  # [L, blocks, block size, Hkv, D]
        for i, mv in enumerate(moves):
            self.moved[mv.request_id] = (mv.leaver, mv.receiver)
            if not mv.num_tokens:
                continue
            if mv.leaver == self.me:
                assert mv.kv is not None
                rank, kv = self.ranks[mv.receiver], mv.kv
                works.append(post(lambda kv=kv, rank=rank, i=i: p2p.isend(kv, rank, tag=move_tag(i)), mv.receiver,
                                  self._lost))  # fmt: skip
                self.stats.scale_down_bytes += kv.numel() * kv.element_size()
                self.stats.scale_down_tokens += mv.num_tokens
            elif mv.receiver == self.me:
                buf = torch.empty(2, layers, mv.num_tokens, hkv, d, dtype=self.shard.cache.k.dtype,
                                  device=self.shard.cache.k.device)  # fmt: skip
                rank = self.ranks[mv.leaver]
                works.append(post(lambda buf=buf, rank=rank, i=i: p2p.irecv(buf, rank, tag=move_tag(i)), mv.leaver,
                                  self._lost))  # fmt: skip
                inbox.append((mv, buf))
        wait_peers(works, self.timeout_s, self._lost)
        for mv, buf in inbox:
            if mv.leaver not in self.lost:
                self.shard.merge(mv.request_id, buf, front=mv.front)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        return stop_reason(seq, token, self.eos_token_ids, self.max_model_len)

    def _exchange_finished(self, outputs: list[KVPOutput]) -> None:
        """Every member learns which requests finished this step; all free their ranges of them."""
        mine = torch.tensor([[o.token, int(o.finished)] for o in outputs], dtype=torch.int64).view(-1, 2)
        bufs, works = {}, []
        for m in self.plan.members:
            if m == self.me or m in self.lost:
                continue
            n = len(self.plan.mastered_by(m))
            if n:
                buf = bufs[m] = torch.empty(n, 2, dtype=torch.int64)
                works.append(post(lambda m=m, buf=buf: p2p.irecv(buf, self.ranks[m], tag=KVP_TAG), m, self._lost))
            if len(outputs):
                works.append(post(lambda m=m: p2p.isend(mine, self.ranks[m], tag=KVP_TAG), m, self._lost))
                self.stats.control_bytes += mine.numel() * 8
        wait_peers(works, self.timeout_s, self._lost)
        self._gather_logprobs(outputs)
        bufs = {m: b for m, b in bufs.items() if m not in self.lost}  # a lost master's tokens: none
        bufs[self.me] = mine
        for m in sorted(bufs):
            for r, (token, done) in zip(self.plan.mastered_by(m), bufs[m].tolist(), strict=True):
                self.last_tokens.append((r.request_id, token, bool(done)))
        for rid, _, done in self.last_tokens:
            if done:
                self._drop(rid)

    def _gather_logprobs(self, outputs: list[KVPOutput]) -> None:
        """The masters send the logprobs of their requests that asked for them to the leader (member 0), which
        publishes every request's tokens; one float64 row per request (`_pack_logprobs`)."""
        self.last_logprobs = {o.request_id: o.logprobs for o in outputs if o.logprobs is not None}
        if self.me != LEADER_MEMBER:
            rows = [_pack_logprobs(o.logprobs) for o in outputs if o.logprobs is not None]
            if rows and LEADER_MEMBER not in self.lost:
                buf = torch.stack(rows)  # [k, LOGPROB_ROW]
                work = post(lambda: p2p.isend(buf, self.ranks[LEADER_MEMBER], tag=KVP_TAG), LEADER_MEMBER, self._lost)
                wait_peers([work], self.timeout_s, self._lost)
                self.stats.control_bytes += buf.numel() * 8
            return
        wanted, bufs, works = {}, {}, []
        for m in self.plan.members:
            if m == self.me or m in self.lost:
                continue
            wanted[m] = [r.request_id for r in self.plan.mastered_by(m) if r.request_id in self.logprob_requests]
            if wanted[m]:
                buf = bufs[m] = torch.empty(len(wanted[m]), LOGPROB_ROW, dtype=torch.float64)
                works.append(post(lambda m=m, buf=buf: p2p.irecv(buf, self.ranks[m], tag=KVP_TAG), m, self._lost))
        wait_peers(works, self.timeout_s, self._lost)
        for m, buf in bufs.items():
            if m not in self.lost:
                self.last_logprobs.update(zip(wanted[m], map(_unpack_logprobs, buf), strict=True))

    def _drop(self, request_id: str) -> None:
        self.logprob_requests.pop(request_id, None)
        self.plan.finish(request_id)
        self.shard.free(request_id)
        self.seqs.pop(request_id, None)
        self.pending = [mv for mv in self.pending if mv.request_id != request_id]

    def abort(self, request_id: str) -> bool:
        """Free `request_id`'s ranges here and forget it (every member makes the same call between steps)."""
        if request_id not in self.plan.requests:
            return False
        self._drop(request_id)
        return True

    @property
    def _lost(self) -> set[int] | None:
        return self.lost if self.survive_loss else None

    def involves(self, request_id: str, member: int) -> bool:
        """`member` masters or holds KV of `request_id`, or sends or receives its KV in a scale-down (pending, or
        in the last step: a leaver that died then may not have delivered)."""
        req = self.plan.requests[request_id]
        moving = [(mv.leaver, mv.receiver) for mv in self.pending if mv.request_id == request_id]
        if request_id in self.moved:
            moving.append(self.moved[request_id])
        return req.master == member or req.range_of(member) is not None or any(member in mv for mv in moving)

    def remove_member(self, member: int) -> list[str]:
        """`member` is gone: drop (and return) every request it masters or holds a range of, and skip it."""
        if member == self.me:
            raise ValueError(f"member {member} cannot remove itself")
        self.lost.add(member)
        dropped = [rid for rid in self.plan.requests if self.involves(rid, member)]
        for rid in dropped:
            self._drop(rid)
        return dropped

    def abort_all(self) -> None:
        """Free everything this member holds (end of a run, or a failed group)."""
        for rid in list(self.plan.requests):
            self._drop(rid)
        self.shard.free_all()
        self.pending, self.moved = [], {}

    @property
    def blocks_used(self) -> int:
        return self.shard.allocator.num_used
