"""Multi-master steps on an elastic group: LoongServe's distributed decoding (§4.2) and Medha's KV-parallel chunked
prefill (§3.4), one code path.

Each request of the step has one master, which runs its dense layers over the request's new tokens (one for a
decode, a prompt chunk's for a chunk) and stores their KV; other members may hold earlier parts of its KV (the
holders). Per layer, on every member (masters and pure holders alike):

1. post every receive: the queries of each request held here and mastered elsewhere, the partial states of our own;
2. write our requests' new k/v here, send each request's queries to its holders;
3. attend our queries over what we hold of them (the new tokens included, causally by position);
4. serve: attend each received query over what we hold of that request, send `(lse, out)` back;
5. merge every holder's state per own query token (`merge_attn_states_many`; a member that sent nothing for a
   token weighs zero).

Who holds what comes from the iteration's flags, which every member gathered, so every message size follows from
the command and that table alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spindle_attention import attention_fwd, merge_attn_states_many
from spindle_attention.distributed import p2p
from spindle_attention.distributed.comm import pack, unpack

from ..engine import Engine
from ..kv_cache import KVCache
from ..sampler import Sampled, TokenLogprobs, sample
from . import parts
from .exchange import Tags, Waiter
from .pipeline import KVPStep, Local, StepWork


def local_entries(engine: Engine, me: int, works: list[StepWork]) -> Local:
    """What this member holds of each work it masters or is a holder of, from its directed sequences (call after the
    master's new entries are appended)."""
    out: Local = {}
    bs = engine.config.block_size
    for w in works:
        seq = engine.directed.get(w.request_id)
        if seq is not None and (w.master == me or me in w.holders):
            out[w.request_id] = (parts.slots(seq, bs), parts.positions(seq), seq.num_computed_tokens)
    return out


class MultiMasterContext:
    """The attention of one multi-master step over the layers of `cache` (a whole model's, or one pipeline stage's:
    `ranks` are then the members' processes of that stage)."""

    def __init__(
        self, cache: KVCache, first_layer: int, num_q_heads: int, me: int, ranks: list[int], works: list[StepWork],
        local: Local, new_slots: Tensor, tags: Tags, waiter: Waiter,
    ) -> None:  # fmt: skip
        self.cache, self.me, self.ranks, self.tags, self.waiter = cache, me, ranks, tags, waiter
        self.first_layer = first_layer
        _, _, _, self.hkv, self.d = cache.k.shape
        self.hq = num_q_heads
        self.dtype = cache.k.dtype
        self.mine = [w for w in works if w.master == me]
        self.new_slots = new_slots  # [T] the slots of our requests' new tokens, in `mine` order
        # queries we serve, per master: the works it masters that we hold part of
        self.served = {m: [w for w in works if w.master == m and me in w.holders] for m in range(len(ranks)) if m != me}
        self.served = {m: ws for m, ws in self.served.items() if ws}
        # partial states we get back, per holder: the query rows of our works it holds, in `mine` row order
        rows, at = {}, 0
        for w in self.mine:
            for h in w.holders:
                rows.setdefault(h, []).extend(range(at, at + w.tokens))
            at += w.tokens
        self.rows = {h: torch.tensor(r) for h, r in rows.items()}
        self.local = local

    def attention(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self._exchange(layer, q, k, v)
        assert out is not None
        return out

    def serve_layer(self, layer: int) -> None:
        """One layer's exchange on a member that masters nothing this step."""
        assert not self.mine
        self._exchange(layer, None, None, None)

    def _attend(self, li: int, works: list[StepWork], q: Tensor) -> tuple[Tensor, Tensor]:
        """Partial attention of `works`' queries (`q [T, Hq, D]`, their tokens in order) over what this member holds
        of each: out `[T, Hq, D]`, lse `[Hq, T]`."""
        ks, vs, kpos, qpos, cu_q, cu_k = [], [], [], [], [0], [0]
        for w in works:
            s, pos, first = self.local[w.request_id]
            k, v = parts.read(self.cache, li, s)
            ks.append(k)
            vs.append(v)
            kpos.append(pos)
            qpos.append(torch.arange(first, first + w.tokens))
            cu_q.append(cu_q[-1] + w.tokens)
            cu_k.append(cu_k[-1] + pos.numel())
        dev = q.device  # the positions and offsets beside q (no-ops on the CPU)
        out, lse = attention_fwd(
            q, torch.cat(ks), torch.cat(vs), q_positions=torch.cat(qpos).to(dev), k_positions=torch.cat(kpos).to(dev),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=dev), return_lse=True,
        )  # fmt: skip
        assert lse is not None
        return out, lse

    def _result_specs(self, n: int) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [(torch.float32, (self.hq, n)), (self.dtype, (n, self.hq, self.d))]

    def _state_bytes(self, n: int) -> int:
        return n * self.hq * (4 + self.d * self.dtype.itemsize)

    def _exchange(self, layer: int, q: Tensor | None, k: Tensor | None, v: Tensor | None) -> Tensor | None:
        li = layer - self.first_layer
        dev = self.cache.k.device  # received queries and states land where they are used (p2p stages them)
        q_in = {m: torch.empty(sum(w.tokens for w in ws), self.hq, self.d, dtype=self.dtype, device=dev)
                for m, ws in self.served.items()}  # fmt: skip
        r_in = {h: torch.empty(self._state_bytes(r.numel()), dtype=torch.uint8, device=dev)
                for h, r in self.rows.items()}  # fmt: skip
        recv_q = [p2p.irecv(buf, self.ranks[m], tag=self.tags.query(layer)) for m, buf in q_in.items()]
        recv_r = [p2p.irecv(buf, self.ranks[h], tag=self.tags.result(layer)) for h, buf in r_in.items()]
        sends, keep = [], []
        own = None
        if self.mine:
            assert q is not None and k is not None and v is not None and q.shape[0] == self.new_slots.numel()
            parts.write(self.cache, li, self.new_slots, k, v)
            for h, r in self.rows.items():
                keep.append(q.index_select(0, r.to(q.device)).contiguous())
                sends.append(p2p.isend(keep[-1], self.ranks[h], tag=self.tags.query(layer)))
            own = self._attend(li, self.mine, q)
        self.waiter.wait_all(recv_q, f"layer {layer} queries")
        for m, buf in q_in.items():
            out, lse = self._attend(li, self.served[m], buf)
            keep.append(pack([lse.contiguous(), out.contiguous()]))
            sends.append(p2p.isend(keep[-1], self.ranks[m], tag=self.tags.result(layer)))
        if not self.mine:
            self.waiter.wait_all(sends, f"layer {layer} states")
            return None
        assert own is not None and q is not None
        self.waiter.wait_all(recv_r, f"layer {layer} partial states")
        t = q.shape[0]
        outs = q.new_zeros(len(self.ranks), t, self.hq, self.d)
        lses = torch.full((len(self.ranks), self.hq, t), float("-inf"), device=q.device)
        outs[self.me], lses[self.me] = own
        for h, buf in r_in.items():
            r = self.rows[h]
            lse, out = unpack(buf, self._result_specs(r.numel()))
            outs[h, r], lses[h][:, r] = out, lse
        merged, _ = merge_attn_states_many(outs, lses)
        self.waiter.wait_all(sends, f"layer {layer} sends")
        return merged.to(q.dtype)


@torch.inference_mode()
def multi_master_step(
    engine: Engine, me: int, ranks: list[int], works: list[StepWork], tags: Tags, waiter: Waiter
) -> dict[str, tuple[int, TokenLogprobs | None]]:
    """One step of `works` over the group; every member calls it with the same list. The requests this member
    masters must be directed here with room for their new tokens. Returns the tokens sampled here: a decode's, and a
    chunk's that ends its prompt (the first token); sequences are not advanced (the iteration does that).

    On a sequence-pipeline engine (its runner has `multi_master_forward`: Medha's 3D) this member's leader runs the
    first stage's layers and its later stages run theirs, each stage exchanging with the same stage of the others."""
    mine = [w for w in works if w.master == me]
    seqs = [engine.directed[w.request_id] for w in mine]
    slots, positions, ids, last_rows, sampled_seqs = [], [], [], [], []
    for w, s in zip(mine, seqs, strict=True):
        first = s.num_computed_tokens
        assert first + w.tokens <= s.num_tokens, f"{w.request_id}: tokens [{first}, {first + w.tokens}) not known yet"
        slots += [parts.append_entry(engine, s, p) for p in range(first, first + w.tokens)]
        positions += range(first, first + w.tokens)
        ids += s.token_ids[first : first + w.tokens]
        if first + w.tokens == s.num_tokens:  # the request's last known token: its logits sample the next
            last_rows.append(len(positions) - 1)
            sampled_seqs.append(s)
    local = local_entries(engine, me, works)
    new_slots = torch.tensor(slots, dtype=torch.int64)
    model = engine.model
    ctx = MultiMasterContext(engine.cache, model.layer_range[0], model.num_local_q_heads, me, ranks, works, local,
                             new_slots, tags, waiter)  # fmt: skip
    device = engine.cache.k.device
    pipeline = getattr(engine.runner, "multi_master_forward", None)
    if pipeline is not None:
        step = KVPStep.of(tags, me, ranks, works, local, slots, positions, engine.config.block_size)
        hidden = pipeline(ctx, step, ids, last_rows)  # [len(last_rows), H]: the last stage's final rows
    elif not mine:
        for layer in model.layers:
            ctx.serve_layer(layer.layer_id)
        return {}
    else:
        out = model(torch.tensor(positions).to(device), ctx, input_ids=torch.tensor(ids).to(device))
        hidden = out[torch.tensor(last_rows, dtype=torch.long).to(device)]
    if not last_rows:
        return {}
    logits = engine.runner.compute_logits(hidden)  # [B, vocab]
    sampled: Sampled = sample(logits, sampled_seqs, engine.generator, engine.eos_token_ids, engine.grammars)
    rids = [s.request_id for s in sampled_seqs]
    return {rid: (t, lp) for rid, t, lp in zip(rids, sampled.tokens, sampled.logprobs, strict=True)}
