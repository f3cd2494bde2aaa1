"""The attention context of one KVP decode step on one member: the per-layer q / partial-state exchange.

Per layer, on every member of the lockstep group (masters and pure holders alike):

1. post every receive: queries from each master whose requests this member holds, partial states from
   each holder of the requests this member masters;
2. send each holder the rows it serves: q of each request (`[Hq, D]`), plus that token's k and v when the
   holder is the request's tail (a master that is the tail writes them locally instead);
3. write the own tail k/v, then attend the own queries over the own ranges (overlapping the sends);
4. serve: write the received tail k/v, attend the received queries (one batched `paged_decode`), send
   back `(lse, out)` per row;
5. merge each own request's states, in holder order, with `merge_attn_states_many`.

Every message size follows from the shared `KVPPlan` (the rows of a message are the requests in admission
order), so no header travels. A peer in `lost` (its process died, wire.py) is skipped: the exchanges between
the others do not depend on it, so their requests stay exact; the rows of requests it held or mastered get
garbage (a missing partial state counts as zeros), and the leader drops those requests after the step.
Tags, on the default group above the RankGroup range: `KVP_TAG` for the
per-step control message, `KVP_TAG + 1 + 2 * layer` for queries and `KVP_TAG + 2 + 2 * layer` for results,
`KVP_TAG + 4096 + i` for the i-th scale-down KV move at the start of a step (decoder.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention import merge_attn_states_many
from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import RANK_GROUP_TAG, pack, unpack

from .plan import KVPPlan, KVPRequest
from .shard import KVShard
from .wire import post, wait_peers

KVP_TAG = RANK_GROUP_TAG + 4096


def query_tag(layer: int) -> int:
    return KVP_TAG + 1 + 2 * layer


def result_tag(layer: int) -> int:
    return KVP_TAG + 2 + 2 * layer


MAX_MOVES = 4096  # scale-down moves in one step (each has its own tag)


def move_tag(i: int) -> int:
    assert 0 <= i < MAX_MOVES, f"scale-down move {i} of one step has no tag"
    return KVP_TAG + 4096 + i


@dataclass
class KVPStats:
    """Bytes this member sent (and host seconds), accumulated over steps; never asserted on timing."""

    q_bytes: int = 0  # queries sent to holders
    kv_bytes: int = 0  # new-token k/v sent to a remote tail
    result_bytes: int = 0  # (lse, out) partial states sent back to masters
    control_bytes: int = 0  # per-step sampled tokens / finished flags
    kv_move_bytes: int = 0  # what moving the remote KV to the masters would have cost instead
    scale_down_bytes: int = 0  # KV this member sent when it left a request's holders (once per scale-down)
    scale_down_tokens: int = 0  # the tokens of that KV
    attention_s: float = 0.0  # local partial attention (own and served queries)
    layer_s: float = 0.0  # whole per-layer exchanges, attention included
    step_s: float = 0.0  # whole steps: model, exchanges, sampling, control message

    @property
    def sent_bytes(self) -> int:
        """The per-step traffic (scale-down moves, once per scale-down, are counted apart)."""
        return self.q_bytes + self.kv_bytes + self.result_bytes + self.control_bytes


class KVPAttentionContext:
    def __init__(
        self,
        plan: KVPPlan,
        me: int,
        ranks: dict[int, int],
        shard: KVShard,
        *,
        first_layer: int,
        num_q_heads: int,
        tail_slots: dict[str, Tensor],
        stats: KVPStats,
        timeout_s: float | None = None,
        lost: set[int] | None = None,
    ) -> None:
        self.me, self.ranks, self.shard, self.stats = me, ranks, shard, stats
        self.lost = lost  # members found dead (shared with the member; may grow); None: a dead peer raises
        self.timeout_s = timeout_s  # longest wait for one peer message; None = forever
        self.first_layer = first_layer
        _, _, _, self.hkv, self.d = shard.cache.k.shape
        self.hq = num_q_heads
        self.dtype = shard.cache.k.dtype
        self.tail_slots = tail_slots  # flat slot of this step's token, for every request whose tail is here
        self.batch = plan.mastered_by(me)  # the model's rows, in admission order
        peers = [m for m in plan.members if m != me]
        self.out_q = {h: rs for h in peers if (rs := plan.served(me, h))}  # my queries per holder
        self.in_q = {m: rs for m in peers if (rs := plan.served(m, me))}  # queries I serve per master
        self.own_local = [i for i, r in enumerate(self.batch) if me in r.holders]
        self._keep: list[Tensor] = []  # send buffers, alive until their sends complete

    def _query_numel(self, reqs: list[KVPRequest], holder: int) -> int:
        return sum(self.hq * self.d + (2 * self.hkv * self.d if r.tail == holder else 0) for r in reqs)

    def _result_specs(self, n: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [(torch.float32, (self.hq, n)), (self.dtype, (n, self.hq, self.d))]

    def _result_nbytes(self, n: int) -> int:
        return n * self.hq * (4 + self.d * self.dtype.itemsize)

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self._exchange(layer, q, k, v)
        assert out is not None
        return out

    def serve_layer(self, layer: int) -> None:
        """One layer's exchange on a member that masters nothing this step (it only serves)."""
        assert not self.batch, "a member with requests of its own runs the model, which calls attention()"
        self._exchange(layer, None, None, None)

    def _exchange(self, layer: int, q: Tensor | None, k: Tensor | None, v: Tensor | None) -> Tensor | None:
        li = layer - self.first_layer
        t0 = time.perf_counter()
        lost = self.lost or set()
        in_q = {m: rs for m, rs in self.in_q.items() if m not in lost}
        out_q = {h: rs for h, rs in self.out_q.items() if h not in lost}
        dev = self.shard.cache.k.device  # received q/k/v and states land where they are used (p2p stages them)
        q_in = {m: torch.empty(self._query_numel(rs, self.me), dtype=self.dtype, device=dev) for m, rs in in_q.items()}
        r_in = {h: torch.empty(self._result_nbytes(len(rs)), dtype=torch.uint8, device=dev) for h, rs in out_q.items()}
        q_works = [self._post(p2p.irecv, buf, m, query_tag(layer)) for m, buf in q_in.items()]
        r_works = [self._post(p2p.irecv, buf, h, result_tag(layer)) for h, buf in r_in.items()]
        sends = []
        row = {r.request_id: i for i, r in enumerate(self.batch)}
        if self.batch:
            assert q is not None and k is not None and v is not None and q.shape[0] == len(self.batch)
            for h, rs in out_q.items():
                parts = []
                for r in rs:
                    i = row[r.request_id]
                    parts.append(q[i].reshape(-1))
                    self.stats.q_bytes += q[i].numel() * q.element_size()
                    if r.tail == h:
                        parts += [k[i].reshape(-1), v[i].reshape(-1)]
                        self.stats.kv_bytes += 2 * k[i].numel() * k.element_size()
                self._keep.append(torch.cat(parts))
                sends.append(self._post(p2p.isend, self._keep[-1], h, query_tag(layer)))
            for i, r in enumerate(self.batch):
                if r.tail == self.me:
                    self.shard.write(li, self.tail_slots[r.request_id], k[i : i + 1], v[i : i + 1])
            ta = time.perf_counter()
            own = None
            if self.own_local:
                rows = torch.tensor(self.own_local, device=q.device)
                own = self.shard.attend(li, [self.batch[i].request_id for i in self.own_local], q[rows])
            self.stats.attention_s += time.perf_counter() - ta
        sends += self._serve(li, layer, q_works, q_in, in_q)
        if not self.batch:
            self._wait(sends)
            self._keep.clear()
            self.stats.layer_s += time.perf_counter() - t0
            return None
        self._wait(r_works)
        states: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}  # (holder, request) -> (out [Hq, D], lse [Hq])
        for h, rs in out_q.items():
            if h in lost:
                continue
            lse, out = unpack(r_in[h], self._result_specs(len(rs)))
            for j, r in enumerate(rs):
                states[(h, r.request_id)] = (out[j], lse[:, j])
        if own is not None:
            for j, i in enumerate(self.own_local):
                states[(self.me, self.batch[i].request_id)] = (own[0][j], own[1][:, j])
        depth = max(len(r.holders) for r in self.batch)
        outs = q.new_zeros(depth, len(self.batch), self.hq, self.d)
        lses = torch.full((depth, self.hq, len(self.batch)), float("-inf"), device=q.device)
        for i, r in enumerate(self.batch):
            for s, h in enumerate(r.holders):
                state = states.get((h, r.request_id))
                if state is not None:  # missing: a lost holder (out 0, lse 0 keep the garbage row finite)
                    outs[s, i], lses[s, :, i] = state
                else:
                    lses[s, :, i] = 0.0
        merged, _ = merge_attn_states_many(outs, lses)
        self._wait(sends)
        self._keep.clear()
        self.stats.layer_s += time.perf_counter() - t0
        return merged

    def _serve(
        self, li: int, layer: int, works: list, q_in: dict[int, Tensor], in_q: dict[int, list[KVPRequest]]
    ) -> list:
        """Write the received tail k/v, attend every received query, send the states back."""
        self._wait(works)
        in_q = {m: rs for m, rs in in_q.items() if m not in (self.lost or ())}
        if not in_q:
            return []
        ta = time.perf_counter()
        ids, qs, counts = [], [], []
        for m, rs in in_q.items():
            buf, off = q_in[m], 0
            for r in rs:
                n = self.hq * self.d
                qs.append(buf[off : off + n].view(self.hq, self.d))
                off += n
                if r.tail == self.me:
                    n = self.hkv * self.d
                    k = buf[off : off + n].view(1, self.hkv, self.d)
                    v = buf[off + n : off + 2 * n].view(1, self.hkv, self.d)
                    self.shard.write(li, self.tail_slots[r.request_id], k, v)
                    off += 2 * n
                ids.append(r.request_id)
            counts.append(len(rs))
        out, lse = self.shard.attend(li, ids, torch.stack(qs))
        self.stats.attention_s += time.perf_counter() - ta
        sends, first = [], 0
        for m, n in zip(in_q, counts, strict=True):
            msg = pack([lse[:, first : first + n].contiguous(), out[first : first + n]])
            self.stats.result_bytes += msg.numel()
            self._keep.append(msg)
            sends.append(self._post(p2p.isend, msg, m, result_tag(layer)))
            first += n
        return sends

    def _post(self, op: Callable[..., dist.Work], buf: Tensor, member: int, tag: int) -> tuple[int, dist.Work | None]:
        return post(lambda: op(buf, self.ranks[member], tag=tag), member, self.lost)

    def _wait(self, works: list) -> None:
        wait_peers(works, self.timeout_s, self.lost)
