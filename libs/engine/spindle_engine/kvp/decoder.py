"""One member of a KVP decode group: steps the requests it masters and serves the others' queries.

All members of the group run `step()` in lockstep (the same number of times, with the same `add_request`
/ `scale_up` calls between the same steps). A step appends one token to every active request (at its
tail), runs every layer's exchange (`KVPAttentionContext`), samples the mastered requests' next tokens,
then tells every other member which requests finished (one small int64 message per pair, tag `KVP_TAG`),
so each holder frees its ranges of them.

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
import torch.distributed as dist
from torch import Tensor

from spindle_model import LlamaModel

from ..kv_cache import BlockAllocator, KVCache, OutOfBlocksError
from ..sampler import sample
from ..sampling_params import SamplingParams
from ..sequence import Sequence, stop_reason
from .context import KVP_TAG, KVPAttentionContext, KVPStats
from .plan import KVPPlan, KVPRequest
from .shard import KVShard
from .wire import post, wait_peers


@dataclass(frozen=True)
class KVPOutput:
    request_id: str
    token: int
    finished: bool
    finish_reason: str | None


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
        cache = KVCache(len(model.layers), num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype)
        self.shard = KVShard(cache, BlockAllocator(num_blocks, block_size))
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.generator = torch.Generator().manual_seed(seed)
        self.seqs: dict[str, Sequence] = {}  # the requests this member masters
        self.stats = KVPStats()
        self.step_stats: list[KVPStats] = []  # one per step, for reports
        self.keep_logits = keep_logits
        self.logits: dict[str, list[Tensor]] = {}
        self.timeout_s = timeout_s  # longest wait for a peer's message within a step; None = forever
        self.survive_loss = survive_loss  # a dead peer is skipped (lockstep.py); otherwise it raises KVPError
        self.lost: set[int] = set()  # members found dead (skipped from then on)
        self.last_tokens: list[tuple[str, int, bool]] = []  # every request's (id, token, finished) of the last step
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

    # ---- stepping ----

    def has_unfinished(self) -> bool:
        return bool(self.plan.requests)

    @torch.inference_mode()
    def step(self) -> list[KVPOutput]:
        """One decode step of the whole group; returns the tokens of the requests this member masters."""
        self.last_tokens = []
        if not self.plan.requests:
            return []
        t0 = time.perf_counter()
        before = KVPStats(**vars(self.stats))
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
            ids = torch.tensor([s.token_ids[-1] for s in seqs])
            positions = torch.tensor([r.num_tokens - 1 for r in ctx.batch])
            hidden = self.model(positions, ctx, input_ids=ids)
            logits = self.model.compute_logits(hidden)
            tokens = sample(logits, [s.params for s in seqs], [s.step_generator() for s in seqs], self.generator)
            for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
                if self.keep_logits:
                    self.logits[seq.request_id].append(logits[i].clone())
                seq.token_ids.append(token)
                reason = self._stop_reason(seq, token)
                outputs.append(KVPOutput(seq.request_id, token, reason is not None, reason))
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
                works.append(post(lambda m=m, buf=buf: dist.irecv(buf, self.ranks[m], tag=KVP_TAG), m, self._lost))
            if len(outputs):
                works.append(post(lambda m=m: dist.isend(mine, self.ranks[m], tag=KVP_TAG), m, self._lost))
                self.stats.control_bytes += mine.numel() * 8
        wait_peers(works, self.timeout_s, self._lost)
        bufs = {m: b for m, b in bufs.items() if m not in self.lost}  # a lost master's tokens: none
        bufs[self.me] = mine
        for m in sorted(bufs):
            for r, (token, done) in zip(self.plan.mastered_by(m), bufs[m].tolist(), strict=True):
                self.last_tokens.append((r.request_id, token, bool(done)))
        for rid, _, done in self.last_tokens:
            if done:
                self._drop(rid)

    def _drop(self, request_id: str) -> None:
        self.plan.finish(request_id)
        self.shard.free(request_id)
        self.seqs.pop(request_id, None)

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
        req = self.plan.requests[request_id]
        return req.master == member or req.range_of(member) is not None

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

    @property
    def blocks_used(self) -> int:
        return self.shard.allocator.num_used
