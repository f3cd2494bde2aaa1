"""Multi-master decoding on an elastic group (LoongServe §4.2): one decode step over the group's members.

Each request of the step has one master, which runs its dense layers and stores its new token's KV; any member
may hold other parts of its KV. Per layer, on every member (masters and pure holders alike):

1. post every receive: the queries of each other member's requests, the partial states of our own;
2. write our requests' new k/v here, send our queries to every other member;
3. attend our queries over what we hold of them (the new token included);
4. serve: attend each received query over what we hold of that request (nothing: out 0, lse -inf), send
   `(lse, out)` back;
5. merge every member's state per own request (`merge_attn_states_many`).

Queries go to every member of the group, not only to holders, so every message size follows from the command
(each request's master) alone: members need not agree on who holds what. A member holding nothing of a request
answers with an empty state, which the merge weighs zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from spindle_attention import attention_fwd, merge_attn_states_many
from spindle_attention.distributed.comm import pack, unpack

from ..engine import Engine
from ..sampler import Sampled, TokenLogprobs, sample
from . import parts
from .exchange import Tags, Waiter


class ESPDecodeContext:
    def __init__(
        self,
        engine: Engine,
        me: int,
        ranks: list[int],
        masters: list[tuple[str, int]],
        new_slots: Tensor,
        tags: Tags,
        waiter: Waiter,
    ) -> None:
        self.engine, self.me, self.ranks, self.tags, self.waiter = engine, me, ranks, tags, waiter
        self.first_layer = engine.model.layer_range[0]
        _, _, _, self.hkv, self.d = engine.cache.k.shape
        self.hq = engine.model.num_local_q_heads
        self.dtype = engine.cache.k.dtype
        self.by_master = {m: [rid for rid, x in masters if x == m] for m in range(len(ranks))}
        self.mine = self.by_master[me]
        self.new_slots = new_slots  # [B] the slot of each own request's new token
        bs = engine.config.block_size
        self.local: dict[str, tuple[Tensor, Tensor, int]] = {}  # request -> (slots, positions, query position)
        for rid, _ in masters:
            seq = engine.directed.get(rid)
            if seq is not None and parts.num_entries(seq):
                self.local[rid] = (parts.slots(seq, bs), parts.positions(seq), seq.num_tokens - 1)
        self.peers = [m for m in range(len(ranks)) if m != me]

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self._exchange(layer, q, k, v)
        assert out is not None
        return out

    def serve_layer(self, layer: int) -> None:
        """One layer's exchange on a member that masters nothing this step."""
        assert not self.mine
        self._exchange(layer, None, None, None)

    def _attend(self, li: int, rids: list[str], q: Tensor) -> tuple[Tensor, Tensor]:
        """Partial attention of one query per request over what this member holds of it: out `[n, Hq, D]`,
        lse `[Hq, n]` (out 0, lse -inf for a request held nothing of here)."""
        out = q.new_zeros(len(rids), self.hq, self.d)
        lse = torch.full((self.hq, len(rids)), float("-inf"))
        rows = [i for i, r in enumerate(rids) if r in self.local]
        if not rows:
            return out, lse
        ks, vs, kpos, qpos, cu = [], [], [], [], [0]
        for i in rows:
            s, pos, qp = self.local[rids[i]]
            k, v = parts.read(self.engine, li, s)
            ks.append(k)
            vs.append(v)
            kpos.append(pos)
            qpos.append(qp)
            cu.append(cu[-1] + pos.numel())
        idx = torch.tensor(rows)
        o, l_ = attention_fwd(
            q[idx], torch.cat(ks), torch.cat(vs),
            q_positions=torch.tensor(qpos), k_positions=torch.cat(kpos),
            cu_seqlens_q=torch.arange(len(rows) + 1, dtype=torch.int32),
            cu_seqlens_k=torch.tensor(cu, dtype=torch.int32), return_lse=True,
        )  # fmt: skip
        assert l_ is not None
        out[idx], lse[:, idx] = o, l_
        return out, lse

    def _result_specs(self, n: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [(torch.float32, (self.hq, n)), (self.dtype, (n, self.hq, self.d))]

    def _exchange(self, layer: int, q: Tensor | None, k: Tensor | None, v: Tensor | None) -> Tensor | None:
        li = layer - self.first_layer
        b = len(self.mine)
        q_in = {m: torch.empty(len(self.by_master[m]), self.hq, self.d, dtype=self.dtype) for m in self.peers}
        q_in = {m: buf for m, buf in q_in.items() if buf.shape[0]}
        r_in = {h: torch.empty(b * self.hq * (4 + self.d * self.dtype.itemsize), dtype=torch.uint8) for h in self.peers}
        recv_q = [dist.irecv(buf, self.ranks[m], tag=self.tags.query(layer)) for m, buf in q_in.items()]
        recv_r = [dist.irecv(buf, self.ranks[h], tag=self.tags.result(layer)) for h, buf in r_in.items()] if b else []
        sends, keep = [], []
        own = None
        if b:
            assert q is not None and k is not None and v is not None and q.shape[0] == b
            parts.write(self.engine, li, self.new_slots, k, v)
            q_send = q.contiguous()
            sends += [dist.isend(q_send, self.ranks[h], tag=self.tags.query(layer)) for h in self.peers]
            own = self._attend(li, self.mine, q)
        self.waiter.wait_all(recv_q, f"layer {layer} queries")
        for m, buf in q_in.items():
            out, lse = self._attend(li, self.by_master[m], buf)
            keep.append(pack([lse.contiguous(), out.contiguous()]))
            sends.append(dist.isend(keep[-1], self.ranks[m], tag=self.tags.result(layer)))
        if not b:
            self.waiter.wait_all(sends, f"layer {layer} states")
            return None
        assert own is not None and q is not None
        self.waiter.wait_all(recv_r, f"layer {layer} partial states")
        outs = q.new_zeros(len(self.ranks), b, self.hq, self.d)
        lses = torch.full((len(self.ranks), self.hq, b), float("-inf"))
        outs[self.me], lses[self.me] = own
        for h, buf in r_in.items():
            lse, out = unpack(buf, self._result_specs(b))
            outs[h], lses[h] = out, lse
        merged, _ = merge_attn_states_many(outs, lses)
        self.waiter.wait_all(sends, f"layer {layer} sends")
        return merged.to(q.dtype)


@torch.inference_mode()
def decode_step(
    engine: Engine, me: int, ranks: list[int], masters: list[tuple[str, int]], tags: Tags, waiter: Waiter
) -> dict[str, tuple[int, TokenLogprobs | None]]:
    """One decode step of `masters` (request id, master member) over the group; every member calls it with the
    same list. The requests this member masters must be directed here, with room for one more entry. Returns
    their sampled (token, logprobs); their sequences are not advanced (the iteration does that on every member)."""
    mine = [rid for rid, m in masters if m == me]
    seqs = [engine.directed[rid] for rid in mine]
    new_slots = torch.tensor([parts.append_entry(engine, s, s.num_tokens - 1) for s in seqs], dtype=torch.int64)
    ctx = ESPDecodeContext(engine, me, ranks, masters, new_slots, tags, waiter)
    if not seqs:
        for layer in engine.model.layers:
            ctx.serve_layer(layer.layer_id)
        return {}
    positions = torch.tensor([s.num_tokens - 1 for s in seqs])
    ids = torch.tensor([s.token_ids[-1] for s in seqs])
    hidden = engine.model(positions.to(engine.cache.k.device), ctx, input_ids=ids.to(engine.cache.k.device))
    logits = engine.model.compute_logits(hidden)  # [B, vocab]
    sampled: Sampled = sample(logits, seqs, engine.generator, engine.eos_token_ids, engine.grammars)
    return {rid: (t, lp) for rid, t, lp in zip(mine, sampled.tokens, sampled.logprobs, strict=True)}
