"""LoongServe's unified distributed KV pool as the global manager keeps it: which instance holds how many KV
tokens of which request, the room reserved for each request's future tokens on its master, and the decode
groups (ESP groups running a decoding batch).

Room is counted in each instance's blocks: a request's entry on an instance (its KV there, plus, on its master,
the tokens it may still generate) takes ceil(tokens / block_size) blocks, so a plan that fits here fits the
instance. Reserving every request's remaining tokens at dispatch is how the manager never forces an eviction
(§5.1's memory constraint); scale-up for memory is then never needed, and scale-up is for compute only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Member:
    """An elastic instance."""

    id: str
    node: str
    rank: int
    total_blocks: int
    block_size: int
    held: dict[str, int] = field(default_factory=dict)  # request id -> KV tokens here now
    reserved: dict[str, int] = field(default_factory=dict)  # request id -> future tokens it masters here
    busy: bool = False  # running an iteration (or a migration) now
    group: int | None = None  # the decode group it belongs to (None: idle between iterations)
    _used: int = 0  # blocks `held` and `reserved` take (changed through `set` and `drop` only)

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def used_blocks(self) -> int:
        return self._used

    def _tokens(self, rid: str) -> int:
        return self.held.get(rid, 0) + self.reserved.get(rid, 0)

    def set(self, rid: str, held: int | None = None, reserved: int | None = None) -> None:
        """`rid` holds `held` KV tokens here and reserves `reserved` more (None: unchanged); the blocks they take
        are counted as they change, so `used_blocks` costs nothing."""
        before = self.blocks(self._tokens(rid))
        if held is not None:
            self.held[rid] = held
        if reserved is not None:
            self.reserved[rid] = reserved
        self._used += self.blocks(self._tokens(rid)) - before

    def free_tokens(self) -> int:
        """Tokens a new request's entry could take here."""
        return max(0, self.total_blocks - self.used_blocks()) * self.block_size

    def room_for(self, rid: str, tokens: int) -> bool:
        """`tokens` more (KV or reservation) for `rid` fit here."""
        have = self.held.get(rid, 0) + self.reserved.get(rid, 0)
        extra = self.blocks(have + tokens) - self.blocks(have)
        return self.used_blocks() + extra <= self.total_blocks

    def room_tokens(self, rid: str) -> int:
        """The most tokens of `rid` that still fit here beside what it holds and reserves."""
        have = self.held.get(rid, 0) + self.reserved.get(rid, 0)
        free_blocks = max(0, self.total_blocks - self.used_blocks())
        return (self.blocks(have) + free_blocks) * self.block_size - have

    def kv_tokens(self) -> int:
        return sum(self.held.values())

    def unreserve(self, rid: str) -> None:
        """`rid` reserves nothing here any more (its master moved)."""
        before = self.blocks(self._tokens(rid))
        self.reserved.pop(rid, None)
        self._used += self.blocks(self._tokens(rid)) - before

    def drop(self, rid: str) -> None:
        self._used -= self.blocks(self._tokens(rid))
        self.held.pop(rid, None)
        self.reserved.pop(rid, None)


@dataclass
class Decoding:
    """A request in its decoding phase, as the manager tracks it."""

    rid: str
    prompt: int
    max_tokens: int
    master: str
    started: float  # when it started decoding
    outputs: int = 1  # tokens out (the prefill's first one included)

    @property
    def left(self) -> int:
        """Tokens it may still generate."""
        return max(0, self.max_tokens - self.outputs)


@dataclass
class Group:
    """An ESP group running one decoding batch, iteration after iteration."""

    id: int
    members: list[str]
    requests: list[str]
    running: int | None = None  # batch id of the iteration in flight
    paused_for: set[int] = field(default_factory=set)  # prefills (batch ids) it lent instances to (§5.1)
    migrating: int = 0  # MigrateKV in flight off its members (§5.2)
