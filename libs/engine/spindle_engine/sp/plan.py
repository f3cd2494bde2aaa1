"""Sequence-parallel prefill plans and where every token's KV lives while they run.

A plan is a list of chunks `(token range, member group, layout)` that tile the prompt. Members are small
integers naming prefill instances (the caller maps them to data-plane ranks). Each chunk's group contains
the previous chunk's group (Tetris's constraint: a group only grows). Text form, as `spindle verify` takes it:

    0:300@0;300:900@0,1;900:@0,1,2,3          the third chunk runs to the end of the prompt
    0:1000@0,1/stripe;1000:@0,1,2/all-to-all    a per-chunk layout after '/'

Layouts: `contiguous`, `stripe`, `zigzag` (ring attention) and `all-to-all` (Ulysses attention over a
contiguous split). Placement is a pure function of the plan, so every member (and a decode instance that
receives the KV) computes the same answer without exchanging metadata: a member holds its shard of every
chunk it ran plus what re-balancing moved to it. Before a chunk whose group is larger, the history is
re-balanced evenly (`_runs` sizes over the new group): members with surplus hand their trailing entries,
in member order, to members below their share (Tetris Fig. 5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from spindle_attention.distributed import LAYOUTS, shard_indices
from spindle_attention.distributed.layouts import _runs

SP_LAYOUTS: tuple[str, ...] = (*LAYOUTS, "all-to-all")


@dataclass(frozen=True)
class SPChunk:
    start: int
    end: int
    members: tuple[int, ...]
    layout: str = "zigzag"

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"chunk [{self.start}, {self.end}) is empty or negative")
        if not self.members:
            raise ValueError(f"chunk [{self.start}, {self.end}) has no members")
        if len(set(self.members)) != len(self.members) or min(self.members) < 0:
            raise ValueError(f"chunk members {self.members} must be distinct non-negative integers")
        if self.layout not in SP_LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; expected one of {SP_LAYOUTS}")

    @property
    def sp(self) -> int:
        return len(self.members)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def attention(self) -> str:
        return "ulysses" if self.layout == "all-to-all" else "ring"

    @property
    def shard_layout(self) -> str:
        return "contiguous" if self.layout == "all-to-all" else self.layout

    def shard_positions(self) -> list[Tensor]:
        """Absolute positions each member (in `members` order) computes in this chunk."""
        return [i + self.start for i in shard_indices(self.num_tokens, self.sp, self.shard_layout)]


@dataclass(frozen=True)
class SPPlan:
    chunks: tuple[SPChunk, ...]

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError("a plan needs at least one chunk")
        if self.chunks[0].start != 0:
            raise ValueError(f"the first chunk must start at token 0, not {self.chunks[0].start}")
        for prev, cur in zip(self.chunks, self.chunks[1:], strict=False):
            if cur.start != prev.end:
                raise ValueError(f"chunks must tile the prompt: [{prev.start}, {prev.end}) then [{cur.start}, ...)")
            if not set(prev.members) <= set(cur.members):
                raise ValueError(f"a chunk's group must contain the previous one's: {prev.members} -> {cur.members}")

    @property
    def num_tokens(self) -> int:
        return self.chunks[-1].end

    @property
    def members(self) -> tuple[int, ...]:
        """Every member, in the order of the last (largest) chunk's group."""
        return self.chunks[-1].members

    @classmethod
    def parse(cls, text: str, num_tokens: int, layout: str = "zigzag") -> SPPlan:
        """Parse `start:end@m,m,...[/layout];...` for a `num_tokens` prompt (an empty end means the prompt's end)."""
        if num_tokens < 1:
            raise ValueError(f"the prompt must have at least one token, got {num_tokens}")
        chunks = []
        for part in filter(None, (p.strip() for p in text.split(";"))):
            try:
                span, rest = part.split("@")
                group, _, chunk_layout = rest.partition("/")
                start_s, end_s = span.split(":")
                start = int(start_s) if start_s.strip() else 0
                end = int(end_s) if end_s.strip() else num_tokens
                members = tuple(int(m) for m in group.split(","))
            except ValueError:
                raise ValueError(f"cannot parse plan chunk {part!r}; expected START:END@M,M[/LAYOUT]") from None
            chunks.append(SPChunk(start, end, members, chunk_layout.strip() or layout))
        plan = cls(tuple(chunks))
        if plan.num_tokens != num_tokens:
            raise ValueError(f"the plan covers {plan.num_tokens} tokens but the prompt has {num_tokens}")
        return plan

    @classmethod
    def single_chunk(cls, num_tokens: int, members: tuple[int, ...], layout: str = "zigzag") -> SPPlan:
        return cls((SPChunk(0, num_tokens, members, layout),))

    def format(self) -> str:
        return ";".join(f"{c.start}:{c.end}@{','.join(map(str, c.members))}/{c.layout}" for c in self.chunks)

    def steps(self) -> list[ChunkStep]:
        """What every member does for each chunk: re-balancing moves, then its shard; see `ChunkStep`."""
        held: dict[int, Tensor] = {}
        out = []
        for k, chunk in enumerate(self.chunks):
            moves: list[Move] = []
            if k > 0 and chunk.sp > self.chunks[k - 1].sp:
                moves = rebalance_moves({m: held.get(m, _EMPTY).numel() for m in chunk.members}, chunk.members)
                for mv in moves:
                    held[mv.dst] = torch.cat([held.get(mv.dst, _EMPTY), held[mv.src][mv.lo : mv.hi]])
                for src in {mv.src for mv in moves}:
                    held[src] = held[src][: min(mv.lo for mv in moves if mv.src == src)]
            history = {m: held.get(m, _EMPTY) for m in chunk.members}
            shards = dict(zip(chunk.members, chunk.shard_positions(), strict=True))
            out.append(ChunkStep(k, chunk, tuple(moves), history, shards))
            for m, pos in shards.items():
                held[m] = torch.cat([held.get(m, _EMPTY), pos])
        return out

    def last_token_member(self) -> int:
        """The member that computes the prompt's last token (and so its logits and the first output token)."""
        last = self.chunks[-1]
        return next(
            m for m, pos in zip(last.members, last.shard_positions(), strict=True) if bool((pos == last.end - 1).any())
        )

    def final_placement(self) -> dict[int, Tensor]:
        """Positions each member holds after the last chunk (its history order, then its last shard)."""
        last = self.steps()[-1]
        return {m: torch.cat([last.history[m], last.shards[m]]) for m in last.chunk.members}


_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class Move:
    """Before a chunk, `src` sends entries `[lo, hi)` of its held KV (in held order) to `dst`, which appends them."""

    src: int
    dst: int
    lo: int
    hi: int

    @property
    def count(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class ChunkStep:
    index: int
    chunk: SPChunk
    moves: tuple[Move, ...]  # re-balancing before the chunk (empty unless the group grew)
    history: dict[int, Tensor]  # member -> positions it holds when the chunk starts (after the moves)
    shards: dict[int, Tensor]  # member -> positions it computes in this chunk


def rebalance_moves(counts: dict[int, int], members: tuple[int, ...]) -> list[Move]:
    """Moves that make every member hold its even share (`_runs` sizes in member order) of the history."""
    total = sum(counts[m] for m in members)
    target = {m: e - s for m, (s, e) in zip(members, _runs(total, len(members)), strict=True)}
    surplus = [(m, target[m], counts[m]) for m in members if counts[m] > target[m]]  # (src, keep, have)
    deficit = [(m, target[m] - counts[m]) for m in members if counts[m] < target[m]]
    moves, si = [], 0
    for dst, need in deficit:
        while need:
            src, lo, have = surplus[si]
            take = min(need, have - lo)
            moves.append(Move(src, dst, lo, lo + take))
            need -= take
            lo += take
            surplus[si] = (src, lo, have)
            if lo == have:
                si += 1
    return moves


def retention_targets(num_tokens: int, members: tuple[int, ...]) -> dict[int, Tensor]:
    """Contiguous even split of `[0, num_tokens)` over `members`: what each keeps for decode."""
    return {
        m: torch.arange(s, e, dtype=torch.int64)
        for m, (s, e) in zip(members, _runs(num_tokens, len(members)), strict=True)
    }
