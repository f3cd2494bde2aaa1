"""One iteration of an elastic group, as every member runs it (the scheduler sends each member the same command).

1. **Agree.** Each member says, per request of the command, whether it can take part (`READY`), does not have it
   (`ABSENT`: a decode it holds nothing of, or one that already ended), saw it aborted, has no room, or could not
   load its prompt; one all-gather gives everyone the same table. A prefill runs when every member is ready, a
   decode when some member has it and none objects. So an abort or a finish that reached the members at
   different times never makes them disagree on what runs (which would leave one waiting on another).
2. **Hand over** each decode or chunk whose master does not have it yet (scale-up spread the masters, or a
   prompt's KV spilled onto another member): the lowest member that has it sends the tokens so far, how many are
   computed, and the caller's encoded spec.
3. **Prefill** each prompt over the whole group (prefill.py), members retaining their ranges; the ranges go to
   blocks after the last pass, so the cache holds one pass's shard at a time beside them.
4. **Multi-master step** (decode.py): one token of every decode, and every prompt chunk (Medha's KVP: the next
   tokens of a prompt computed by one member, attending the earlier KV wherever it is held), each on its master.
5. **Share tokens.** The member that sampled a request's token (its prefill's last-token member, or its
   master) sends it, and whether it ended, to everyone, so every member holding part of a request keeps the same
   tokens (any of them may master it later) and frees its part when it ends. A member left holding nothing of a
   request it does not master forgets it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..engine import Engine
from ..sampler import TokenLogprobs, sample
from ..sampling_params import SamplingParams
from ..sequence import Sequence
from . import parts
from .decode import multi_master_step
from .exchange import Handover, Tags, Waiter, all_gather, recv_handover, send_handover
from .pipeline import StepWork
from .prefill import keep, prefill_part, shard_tokens


class Flag(enum.IntEnum):
    ABSENT = 0
    READY = 1
    ABORTED = 2
    NO_ROOM = 3
    NOT_LOADED = 4
    OUT_OF_ORDER = 5  # a chunk that does not start where the prompt's computed tokens end


@dataclass(frozen=True)
class PrefillWork:
    request_id: str
    retain: dict[int, tuple[int, int]]  # member -> the prompt range it keeps


@dataclass(frozen=True)
class DecodeWork:
    request_id: str
    master: int


@dataclass(frozen=True)
class ChunkWork:
    """Prompt tokens [start, end) computed by `master` alone, attending the prompt's earlier KV on every member that
    holds some (Medha's KV parallelism); `master` keeps their KV. A chunk at 0 must be directed on its master."""

    request_id: str
    master: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ESPOutput:
    """A token this member sampled (it publishes it)."""

    request_id: str
    token: int
    index: int  # its output index (0: the prompt's first token)
    finish_reason: str | None
    logprobs: TokenLogprobs | None


@dataclass
class IterationResult:
    outputs: list[ESPOutput] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # requests this member forgot (not run, ended, or none held here)
    refused: dict[str, Flag] = field(default_factory=dict)  # not run: this member reports them (the first objector)
    handed: dict[str, bytes] = field(default_factory=dict)  # requests this member masters from now on: their specs


def _flags(
    engine: Engine,
    me: int,
    group: int,
    prefills: list[PrefillWork],
    chunks: list[ChunkWork],
    decodes: list[DecodeWork],
    aborted: set[str],
) -> torch.Tensor:
    """`[rows, 2]`: per request of the command (prefills, chunks, decodes), this member's flag and the KV entries it
    holds of it (the holders a multi-master step sends queries to)."""
    out = []
    for p in prefills:
        seq = engine.directed.get(p.request_id)
        if p.request_id in aborted:
            out.append(Flag.ABORTED)
        elif seq is None or seq.block_table:
            out.append(Flag.NOT_LOADED)
        else:
            out.append(Flag.READY)
    # each prompt's pass holds this member's shard of it; the ranges it retains go to blocks after the last pass
    bs = engine.config.block_size
    shards, kept = [0], 0
    for p in prefills:
        if p.request_id in engine.directed:
            s, e = p.retain.get(me, (0, 0))
            kept += -(-(e - s) // bs)
            shards.append(-(-shard_tokens(engine.directed[p.request_id].num_prompt_tokens, group, me) // bs))
    mastered = sum(-(-c.tokens // bs) + 1 for c in chunks if c.master == me)
    need = max(max(shards), kept) + mastered + sum(1 for d in decodes if d.master == me)
    if need > engine.allocator.num_free:
        out = [Flag.NO_ROOM if f == Flag.READY else f for f in out]
    for c in chunks:
        seq = engine.directed.get(c.request_id)
        if c.request_id in aborted:
            out.append(Flag.ABORTED)
        elif seq is None:
            if c.master == me and c.start == 0:
                out.append(Flag.NOT_LOADED)
            elif c.master == me and not engine.allocator.can_allocate(c.tokens, []):
                out.append(Flag.NO_ROOM)
            else:
                out.append(Flag.ABSENT)
        elif seq.num_computed_tokens != c.start or c.end > seq.num_prompt_tokens:
            out.append(Flag.OUT_OF_ORDER)
        elif c.master == me and (need > engine.allocator.num_free or not parts.room_for(engine, seq, c.tokens)):
            out.append(Flag.NO_ROOM)
        else:
            out.append(Flag.READY)
    for d in decodes:
        seq = engine.directed.get(d.request_id)
        if d.request_id in aborted:
            out.append(Flag.ABORTED)
        elif seq is None:
            out.append(Flag.ABSENT)
        elif d.master == me and not parts.room_for(engine, seq, 1):
            out.append(Flag.NO_ROOM)
        else:
            out.append(Flag.READY)
    rids = [p.request_id for p in prefills] + [c.request_id for c in chunks] + [d.request_id for d in decodes]
    held = [parts.num_entries(s) if (s := engine.directed.get(rid)) is not None else 0 for rid in rids]
    return torch.tensor([[int(f), n] for f, n in zip(out, held, strict=True)], dtype=torch.int64).reshape(-1, 2)


_BLOCKING = (Flag.ABORTED, Flag.NO_ROOM, Flag.NOT_LOADED, Flag.OUT_OF_ORDER)


def run_iteration(
    engine: Engine,
    me: int,
    ranks: list[int],
    prefills: list[PrefillWork],
    decodes: list[DecodeWork],
    *,
    chunks: Iterable[ChunkWork] = (),
    aborted: set[str],
    spec_of: Callable[[str], bytes],
    params_of: Callable[[bytes], SamplingParams],
    batch_id: int = 0,
    cancel: threading.Event | None = None,
    timeout_s: float = 60.0,
) -> IterationResult:
    """Run the iteration on this member (`me`: its index in `ranks`). Prefill requests must be directed here
    (`Engine.add_directed`, nothing computed), and a chunk at 0 on its master. `spec_of(request_id)` encodes a
    request this member hands over, `params_of` decodes one it receives. The iteration talks under its `batch_id`'s
    tags. Raises ESPError when a member fails mid-way, `cancel` is set (another member gave up) or a peer is silent
    for `timeout_s`; its requests' state here is then undefined and the caller drops them."""
    res = IterationResult()
    g = len(ranks)
    chunks = list(chunks)
    tags, waiter = Tags.for_batch(batch_id), Waiter(timeout_s, cancel)
    mine = _flags(engine, me, g, prefills, chunks, decodes, aborted)
    table = all_gather(mine, me, ranks, tags.flags, waiter, "flags")  # [members, rows, 2]
    flags, held = table[:, :, 0], table[:, :, 1]
    rows = [p.request_id for p in prefills] + [c.request_id for c in chunks] + [d.request_id for d in decodes]
    n_pre = len(prefills)
    run: list[bool] = []
    for j, rid in enumerate(rows):
        col = flags[:, j]
        if j < n_pre:
            ok = bool((col == Flag.READY).all())
        else:
            ok = bool((col == Flag.READY).any()) and not any(bool((col == f).any()) for f in _BLOCKING)
        run.append(ok)
        if ok:
            continue
        objectors = [m for m in range(g) if col[m] in (Flag.NO_ROOM, Flag.NOT_LOADED, Flag.OUT_OF_ORDER)]
        if objectors and objectors[0] == me:
            res.refused[rid] = Flag(int(col[me]))
        else:
            res.gone.append(rid)
        parts.drop(engine, rid)
    run_prefills = [p for p, ok in zip(prefills, run, strict=False) if ok]
    # the multi-master rows that run: chunks, then decodes, as (row, request, master, new tokens)
    multi = [(n_pre + j, c.request_id, c.master, c.tokens) for j, c in enumerate(chunks)]
    multi += [(n_pre + len(chunks) + j, d.request_id, d.master, 1) for j, d in enumerate(decodes)]
    multi = [x for x in multi if run[x[0]]]

    for j, rid, master, _ in multi:  # 2. hand-overs, in command order on every member
        col = flags[:, j]
        if col[master] == Flag.READY:
            continue
        sender = int((col == Flag.READY).nonzero()[0])
        if me == sender:
            seq = engine.directed[rid]
            h = Handover(seq.token_ids, seq.num_prompt_tokens, seq.num_computed_tokens, spec_of(rid))
            send_handover(h, ranks[master], tags, waiter)
        elif me == master:
            h = recv_handover(ranks[sender], engine.max_model_len + 1, tags, waiter)
            parts.new_sequence(engine, rid, h.token_ids, h.num_prompt_tokens, params_of(h.spec), h.num_computed)
            res.handed[rid] = h.spec

    sampled: dict[str, tuple[int, TokenLogprobs | None]] = {}
    retained = []
    for p in run_prefills:  # 3.
        logits, positions, kv = prefill_part(engine, p.request_id, me, ranks, p.retain, tags, waiter)
        retained.append((p.request_id, positions, kv))
        if logits is not None:
            seq = engine.directed[p.request_id]
            s = sample(logits[None], [seq], engine.generator, engine.eos_token_ids, engine.grammars)
            sampled[p.request_id] = (s.tokens[0], s.logprobs[0])
    for rid, positions, kv in retained:
        keep(engine, rid, positions, kv)
    works = [
        StepWork(rid, master, n, tuple(m for m in range(g) if m != master and int(held[m, j]) > 0))
        for j, rid, master, n in multi
    ]
    sampled |= multi_master_step(engine, me, ranks, works, tags, waiter)  # 4.

    ran = [(p.request_id, 0, -1) for p in run_prefills] + [(rid, n, master) for _, rid, master, n in multi]
    out = torch.full((len(ran), 2), -1, dtype=torch.int64)
    reasons: dict[str, str | None] = {}
    for i, (rid, n, _) in enumerate(ran):
        if rid in sampled:
            seq = engine.directed[rid]
            token = sampled[rid][0]
            reasons[rid] = _advance(engine, seq, token, n, holds_new=True)
            out[i] = torch.tensor([token, int(reasons[rid] is not None)])
    shared = all_gather(out, me, ranks, tags.tokens, waiter, "tokens").amax(dim=0)  # 5.
    for i, (rid, n, master) in enumerate(ran):
        token, ended = int(shared[i, 0]), int(shared[i, 1]) > 0
        seq = engine.directed.get(rid)
        if seq is None:
            continue
        if rid in sampled:
            res.outputs.append(ESPOutput(rid, token, len(seq.output_token_ids) - 1, reasons[rid], sampled[rid][1]))
        else:
            _advance(engine, seq, token if token >= 0 else None, n, holds_new=master == me)
        if ended or (parts.num_entries(seq) == 0 and master != me):
            parts.drop(engine, rid, "stop" if ended else "moved")
            if not (ended and rid in sampled):  # a finish the caller publishes ends the job there
                res.gone.append(rid)
    return res


def _advance(engine: Engine, seq: Sequence, token: int | None, new: int, holds_new: bool) -> str | None:
    """After a multi-master step, `new` more tokens of `seq` have KV: here when this member mastered them
    (`holds_new`), else elsewhere; then `token` (if any) follows. Returns why the request ends, if it does."""
    if new:
        if not holds_new and seq.kv_positions is None:  # the new entries are on the master: this one holds a part
            seq.kv_positions = torch.arange(seq.num_computed_tokens)
        seq.num_computed_tokens += new
        if seq.kv_positions is not None:
            parts.set_positions(seq, seq.kv_positions)
    if token is None:
        return None
    seq.token_ids.append(token)
    return engine._stop_reason(seq, token)
