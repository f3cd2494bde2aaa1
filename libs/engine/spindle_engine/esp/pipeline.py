"""A multi-master step as the later stages of a sequence-pipeline member run it (Medha's 3D: KV parallelism across
pipelines, each pipeline SPP stages of one replica).

The member's leader (stage 0) knows every request's state; it sends each later stage, with the step, what that
stage needs to run the step's attention over its own layers and exchange with the same stage of the other members:
the works, where this member's entries of each sit (block tables and position runs: the stages' caches mirror the
leader's block layout), the slots of the tokens it masters, their positions. The stage's peers are the other
members' processes of the same stage (each member's pipeline consecutive ranks from its leader's).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch
from torch import Tensor

from .exchange import Tags

Local = dict[str, tuple[Tensor, Tensor, int]]  # request -> (slots, positions, first query position)


@dataclass(frozen=True)
class StepWork:
    """One request's share of a multi-master step: `tokens` new tokens (its next ones: 1 for a decode) computed by
    `master`, whose queries every member in `holders` (others holding earlier KV of it) attends."""

    request_id: str
    master: int
    tokens: int
    holders: tuple[int, ...]


def _runs(positions: Tensor) -> list[list[int]]:
    """`[n]` increasing positions as [start, end) runs."""
    out: list[list[int]] = []
    for p in positions.tolist():
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out


class KVPStep(msgspec.Struct, frozen=True):
    tag_base: int  # the iteration's tags (`Tags.base`)
    me: int  # this member's index in `leaders`
    leaders: list[int]  # each member's stage-0 rank
    rids: list[str]
    masters: list[int]
    tokens: list[int]
    holders: list[list[int]]
    held: list[int]  # the works held or mastered here (indices into rids)
    tables: list[list[int]]  # per held work: its block table here
    runs: list[list[list[int]]]  # per held work: the positions of its entries here, as [start, end) runs
    firsts: list[int]  # per held work: its first query position
    new_slots: list[int]  # the slots of the tokens this member masters, in work order
    positions: list[int]  # their positions

    @classmethod
    def of(
        cls, tags: Tags, me: int, leaders: list[int], works: list[StepWork], local: Local, new_slots: list[int],
        positions: list[int], block_size: int,
    ) -> KVPStep:  # fmt: skip
        held = [i for i, w in enumerate(works) if w.request_id in local]
        tables, runs, firsts = [], [], []
        for i in held:
            slots, pos, first = local[works[i].request_id]
            blocks = (slots // block_size).tolist()
            tables.append(list(dict.fromkeys(blocks)))
            runs.append(_runs(pos))
            firsts.append(first)
        return cls(
            tags.base, me, list(leaders), [w.request_id for w in works], [w.master for w in works],
            [w.tokens for w in works], [list(w.holders) for w in works], held, tables, runs, firsts, list(new_slots),
            list(positions),
        )  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def check(self, num_blocks: int, block_size: int) -> None:
        """ValueError for a step that does not fit this stage's cache or is not consistent."""
        n = len(self.rids)
        if not (len(self.masters) == len(self.tokens) == len(self.holders) == n):
            raise ValueError(f"a KV-parallel step of {n} requests with {len(self.masters)} masters")
        if not 0 <= self.me < len(self.leaders) or any(not 0 <= m < len(self.leaders) for m in self.masters):
            raise ValueError("a KV-parallel step's member out of range")
        if not (len(self.tables) == len(self.runs) == len(self.firsts) == len(self.held)):
            raise ValueError("a KV-parallel step's held entries do not line up")
        if any(not 0 <= b < num_blocks for t in self.tables for b in t) or any(
            not 0 <= s < num_blocks * block_size for s in self.new_slots
        ):
            raise ValueError(f"a KV-parallel step names a block outside [0, {num_blocks})")
        mine = sum(t for m, t in zip(self.masters, self.tokens, strict=True) if m == self.me)
        if len(self.new_slots) != mine or len(self.positions) != mine:
            raise ValueError(f"a KV-parallel step masters {mine} tokens here but names {len(self.new_slots)} slots")

    def works(self) -> list[StepWork]:
        return [StepWork(r, m, t, tuple(h)) for r, m, t, h in
                zip(self.rids, self.masters, self.tokens, self.holders, strict=True)]  # fmt: skip

    def local(self, block_size: int) -> Local:
        out: Local = {}
        for i, table, runs, first in zip(self.held, self.tables, self.runs, self.firsts, strict=True):
            pos = torch.cat([torch.arange(a, b) for a, b in runs]) if runs else torch.empty(0, dtype=torch.int64)
            e = torch.arange(pos.numel())
            if e.numel() > len(table) * block_size:
                raise ValueError(f"{pos.numel()} entries of {self.rids[i]} in {len(table)} blocks")
            t = torch.tensor(table, dtype=torch.int64)
            slots = t[e // block_size] * block_size + e % block_size if e.numel() else e
            out[self.rids[i]] = (slots, pos, first)
        return out
