"""CSA over all-to-all sequence parallelism (CSPS §3.2.4-3.2.5, Fig. 8): what `spindle_attention.csa` computes on
one process, computed by the SP members together.

Member m holds segment m of `levels` (its q `[n_m, Hq, D]`, k/v `[n_m, Hkv, D]`, positions from the segment's
start; the group's ranks are the members in proximity order, `csa.place_by_proximity`). Level 1 (the own segment,
every head) is local. At level v >= 2 the members of a level-v group split the query heads as Ulysses does
(`head_split` over the group's size) and each computes its heads for the whole group: the queries of the group's
tokens kept at level v against the keys kept at level v outside the query's level-(v-1) group. Causality prunes what
travels: only members with earlier keys outside their lower group send queries at level v, only members with later
queries there send keys and values.

What travels from member r to member p is known to both in advance (the kept counts are fixed per level and segment,
`CSALevels.kept_count`), so no sizes are exchanged. Each KV head's tokens travel in r's importance order (most
important first): the tokens kept at level v are a prefix, nested across levels, so a row that an earlier level sent
is never sent again ("sent once", Fig. 8), and a level's message carries only the rows the earlier levels did not.
Back, p returns each level's output rows and softmax denominators (log-sum-exps) of r's kept queries; r merges the
levels by their log-sum-exps (Eq. 5). A dropped token is neither sent nor computed at that level.

Pipelining (§3.2.5): every level's messages are posted at once, a level's computation starts as soon as its data
has landed (level 1 runs while level 2 travels), and its outputs go back while the next level computes; the
per-level states merge exactly (online softmax over the levels' partitions). Within a level (`partitions="member"`,
the default) each sender's rows are a micro-partition: they are attended as soon as that sender's message has landed
(against the queries and keys already there), while the later members' messages still travel, and a query's
partial states merge by their log-sum-exps at the level's end; `partitions="level"` waits for the whole level
and attends it in one call. Both are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..csa import CSALevels, key_importance, masked_attention
from ..merge import merge_attn_states_many
from . import p2p
from .comm import CommStats, Group, Timer, global_rank, group_rank_size, p2p_args, pack, unpack, wait
from .csa_level import LevelAttention, kept, sends_keys, sends_queries
from .ulysses import head_split, ulysses_attention

FORWARD_TAG, BACK_TAG = 16, 48  # + level; RankGroup tags above those of the ring, metadata and all-to-all
KINDS = ("pos", "k", "v", "q")  # the order of a message's rows (8-byte positions first, for alignment)
PARTITIONS = ("member", "level")


@dataclass(frozen=True)
class Rows:
    """Rows [start, end) of one head's importance-ordered tokens: `kind` is "pos" / "k" / "v" (a KV head) or "q"."""

    kind: str
    head: int
    start: int
    end: int


def heads_at(levels: CSALevels, level: int, member: int, hq: int, hkv: int) -> tuple[range, range]:
    """The (query heads, KV heads) `member` computes at `level` for its whole level group."""
    a, b = levels.group(level, member)
    (qs, qe), (ks, ke) = head_split(hq, hkv, b - a)[member - a]
    return range(qs, qe), range(ks, ke)


def forward_rows(levels: CSALevels, src: int, dst: int, hq: int, hkv: int, dense: bool) -> dict[int, list[Rows]]:
    """Per level, the rows `src` sends `dst` (positions first, then k, v, q), each row sent once over the levels."""
    g = hq // hkv
    sent: dict[tuple[str, int], int] = {}
    out: dict[int, list[Rows]] = {}
    for level in range(2, levels.num_levels + 1):
        if levels.group(level, src) != levels.group(level, dst):
            continue
        q_heads, kv_heads = heads_at(levels, level, dst, hq, hkv)
        n = kept(levels, level, src, dense)
        need: dict[tuple[str, int], int] = {}
        if sends_keys(levels, level, src):
            for kh in kv_heads:
                need[("k", kh)] = need[("v", kh)] = need[("pos", kh)] = n
        if sends_queries(levels, level, src):
            for h in q_heads:
                need[("q", h)] = n
                need[("pos", h // g)] = max(need.get(("pos", h // g), 0), n)
        rows = []
        for (kind, head), end in sorted(need.items(), key=lambda item: (KINDS.index(item[0][0]), item[0][1])):
            start = sent.get((kind, head), 0)
            if end > start:
                rows.append(Rows(kind, head, start, end))
                sent[(kind, head)] = end
        if rows:
            out[level] = rows
    return out


def back_heads(levels: CSALevels, level: int, src: int, dst: int, hq: int, hkv: int) -> range:
    """The query heads whose level-`level` outputs `dst` returns to `src` (the owner of the queries)."""
    if levels.group(level, src) != levels.group(level, dst) or not sends_queries(levels, level, src):
        return range(0)
    return heads_at(levels, level, dst, hq, hkv)[0]


def csa_all_to_all_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    levels: CSALevels,
    group: Group = None,
    *,
    importance: Tensor | None = None,
    measure: bool = False,
    softmax_scale: float | None = None,
    stats: CommStats | None = None,
    partitions: str = "member",
) -> tuple[Tensor, Tensor, Tensor | None]:
    """CSA of this member's segment. `importance` `[Hkv, n]` ranks its tokens for dropping (None or a drop ratio of
    0: nothing dropped, dense attention). Returns out `[n, Hq, D]`, lse `[Hq, n]` and, with `measure`, the next
    layer's importance of its tokens `[Hkv, n]` (the attention each received from its own segment's queries, per
    query: `CSAPrompt`'s "own" scope, measured without communication). One level is plain all-to-all SP (nothing
    to drop, no importance). `partitions`: "member" (a level's rows attended sender by sender as they land) or
    "level" (the level at once)."""
    if partitions not in PARTITIONS:
        raise ValueError(f"partitions must be one of {PARTITIONS}, got {partitions!r}")
    me, size = group_rank_size(group)
    if size != len(levels.segments):
        raise ValueError(f"{len(levels.segments)} segments over a group of {size}")
    n, hq, d = q.shape
    hkv = k.shape[1]
    s0, s1 = levels.segments[me]
    if n != s1 - s0 or k.shape[0] != n or v.shape[0] != n:
        raise ValueError(f"member {me} holds segment [{s0}, {s1}), got {n} queries and {k.shape[0]} keys")
    if hq % hkv:
        raise ValueError(f"{hq} query heads over {hkv} KV heads")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    positions = torch.arange(s0, s1, device=q.device)
    if levels.num_levels == 1:
        out, lse = ulysses_attention(
            q, k, v, group, q_positions=positions, k_positions=positions, softmax_scale=scale, stats=stats
        )
        return out, lse, None
    dense = importance is None or levels.drop == 0.0
    g, dev, dtype = hq // hkv, q.device, q.dtype
    order = (
        torch.arange(n, device=dev).expand(hkv, n)
        if dense
        else importance.to(dev).argsort(dim=1, descending=True, stable=True)
    )  # [Hkv, n] most important first
    own = {"pos": lambda h: positions[order[h]], "k": lambda h: k[order[h], h], "v": lambda h: v[order[h], h]}
    own["q"] = lambda h: q[order[h // g], h]
    sizes = {"pos": (torch.int64, 8), "k": (dtype, d), "v": (dtype, d), "q": (dtype, d)}

    def specs(rows: list[Rows]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        return [(sizes[r.kind][0], (r.end - r.start,) if r.kind == "pos" else (r.end - r.start, d)) for r in rows]

    def nbytes(rows: list[Rows]) -> int:
        return sum((r.end - r.start) * (8 if r.kind == "pos" else d * q.element_size()) for r in rows)

    # 1. post every level's forward messages (and the receives for the outputs that come back)
    fwd_sends: dict[int, list] = {}  # per level, this member's forward sends
    recv_of: dict[tuple[int, int], tuple[dist.Work, list[Rows], Tensor]] = {}  # (level, sender) -> its message
    for other in range(size):
        if other == me:
            continue
        for level, rows in forward_rows(levels, me, other, hq, hkv, dense).items():
            buf = pack([own[r.kind](r.head)[r.start : r.end] for r in rows])
            fwd_sends.setdefault(level, []).append(_post(p2p.isend, buf, group, other, FORWARD_TAG + level))
            _record(stats, level, sent=buf.numel())
        for level, rows in forward_rows(levels, other, me, hq, hkv, dense).items():
            buf = torch.empty(nbytes(rows), dtype=torch.uint8, device=dev)
            recv_of[level, other] = (_post(p2p.irecv, buf, group, other, FORWARD_TAG + level), rows, buf)
    back_recv: list[tuple[int, int, range, Tensor]] = []
    back_works: list = []
    for other in range(size):
        for level in range(2, levels.num_levels + 1):
            heads = back_heads(levels, level, me, other, hq, hkv)
            if other == me or not heads:
                continue
            rows = kept(levels, level, me, dense)
            buf = torch.empty(len(heads) * rows * (4 + d * q.element_size()), dtype=torch.uint8, device=dev)
            back_works.append(_post(p2p.irecv, buf, group, other, BACK_TAG + level))
            back_recv.append((other, level, heads, buf))

    # 2. level 1 while the rest travels
    with Timer(stats, "compute_s"):
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # [n, n]
        out1, lse1, probs = masked_attention(q, k, v, causal[None], scale, keep_probs=measure)
        new_importance = key_importance(probs, hkv, attended=causal) if measure else None
    states: dict[int, list[tuple[Tensor, Tensor]]] = {h: [] for h in range(hq)}  # per head: (out [n, D], lse [n])
    for h in range(hq):
        states[h].append((out1[:, h], lse1[h]))

    # 3. each level when its data has landed (sender by sender with member partitions); its outputs go back at once
    got: dict[tuple[int, str, int], Tensor] = {}

    def land(other: int, rows: list[Rows], buf: Tensor) -> None:
        for r, part in zip(rows, unpack(buf, specs(rows)), strict=True):
            key = (other, r.kind, r.head)
            got[key] = torch.cat([got[key], part]) if key in got else part

    def rows_of(m: int, kind: str, head: int, count: int) -> Tensor:
        return own[kind](head)[:count] if m == me or not count else got[(m, kind, head)][:count]

    for level in range(2, levels.num_levels + 1):
        q_heads, _ = heads_at(levels, level, me, hq, hkv)
        a, b = levels.group(level, me)
        attend = LevelAttention(levels, level, me, list(q_heads), g, dense, rows_of, scale, dev)
        senders = [me] + [m for m in range(a, b) if m != me]  # own rows first, then the others' as they land
        for block in [[m] for m in senders] if partitions == "member" else [senders]:
            with Timer(stats, "wait_s"):
                for m in block:
                    if (level, m) in recv_of:
                        wait(recv_of[level, m][0])
            for m in block:
                if (level, m) in recv_of:
                    land(m, *recv_of[level, m][1:])
            if q_heads:
                with Timer(stats, "compute_s"):
                    attend.add(block)
        with Timer(stats, "wait_s"):
            for work in fwd_sends.get(level, []):
                wait(work)
        if not q_heads:
            continue
        per_member = attend.states()
        for m, parts in per_member.items():
            if m == me:
                for h, (o, lse) in zip(q_heads, parts, strict=True):
                    states[h].append(_scatter(o, lse, order[h // g], n))
                continue
            buf = pack([lse for _, lse in parts] + [o.contiguous() for o, _ in parts])
            back_works.append(_post(p2p.isend, buf, group, m, BACK_TAG + level))
            _record(stats, level, sent=buf.numel(), back=True)

    # 4. the levels' states of this member's queries, merged
    with Timer(stats, "wait_s"):
        for work in back_works:
            wait(work)
    for _, level, heads, buf in back_recv:
        c = kept(levels, level, me, dense)
        parts = unpack(buf, [(torch.float32, (c,))] * len(heads) + [(dtype, (c, d))] * len(heads))
        for i, h in enumerate(heads):
            states[h].append(_scatter(parts[len(heads) + i], parts[i], order[h // g], n))
    outs, lses = [], []
    for h in range(hq):
        o, lse = merge_attn_states_many([s[0][:, None] for s in states[h]], [s[1][None] for s in states[h]])
        outs.append(o), lses.append(lse)
    return torch.cat(outs, dim=1).to(dtype), torch.cat(lses), new_importance


def _post(op: Callable[..., dist.Work], buf: Tensor, group: Group, peer: int, tag: int) -> dist.Work:
    pg, t = p2p_args(group, tag)
    return op(buf, global_rank(group, peer), group=pg, tag=t)


def _record(stats: CommStats | None, level: int, *, sent: int, back: bool = False) -> None:
    if stats is not None:
        key = f"level{level}_{'back' if back else 'forward'}"
        stats.bytes_by_phase[key] = stats.bytes_by_phase.get(key, 0) + sent
        stats.record(sent, 0, sent)


def _scatter(out: Tensor, lse: Tensor, order: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """A level's state over the kept prefix of `order`, spread over the member's n tokens (empty rows: -inf)."""
    full_out = out.new_zeros(n, out.shape[-1])
    full_lse = torch.full((n,), float("-inf"), device=lse.device)
    idx = order[: out.shape[0]]
    full_out[idx], full_lse[idx] = out, lse.float()
    return full_out, full_lse
