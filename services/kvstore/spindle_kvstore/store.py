"""The kvstore's pure core: KV tensors of token ranges of requests, in a host-memory byte budget.

An entry holds tokens [start, end) of one request as a [2, layers, tokens, kv_heads, head_dim] tensor
(the token axis is dim 2). Entries are either reserved (their receive is in flight, not readable, never
evicted) or ready. When a new entry does not fit, ready unpinned entries are evicted least recently used
first; pinned entries are never evicted. A get may cover several adjacent entries of one request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

TOKEN_DIM = 2
Key = tuple[str, int, int]  # (request_id, start, end)


@dataclass(eq=False)
class Entry:
    request_id: str
    start: int
    end: int
    tensor: torch.Tensor
    pinned: bool
    ready: bool = False

    @property
    def key(self) -> Key:
        return (self.request_id, self.start, self.end)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


@dataclass(frozen=True)
class StoreStats:
    bytes_total: int
    bytes_used: int
    num_entries: int
    evictions: int
    requests: dict[str, int] = field(default_factory=dict)  # request id -> bytes held (reserved or ready)


def check_kv_shape(shape: list[int] | tuple[int, ...], start: int, end: int) -> None:
    """ValueError unless `shape` is [2, layers, end - start, kv_heads, head_dim] with 0 <= start < end."""
    if not 0 <= start < end:
        raise ValueError(f"token range [{start}, {end}) is empty or negative")
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(f"KV shape {list(shape)} is not [2, layers, tokens, kv_heads, head_dim]")
    if shape[TOKEN_DIM] != end - start:
        raise ValueError(f"KV shape {list(shape)} holds {shape[TOKEN_DIM]} tokens, not {end - start}")


class KVStore:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self.evictions = 0
        self._entries: OrderedDict[Key, Entry] = OrderedDict()  # least recently used first
        self._by_request: dict[str, dict[Key, Entry]] = {}

    # ---- writing ----

    def reserve(
        self, request_id: str, start: int, end: int, dtype: torch.dtype, shape: list[int], pinned: bool = True
    ) -> Entry | None:
        """Allocate an entry to receive into; None when it cannot fit even after evicting unpinned entries.

        ValueError for a bad shape or a range that is already stored. `commit` makes it readable.
        """
        check_kv_shape(shape, start, end)
        if (request_id, start, end) in self._entries:
            raise ValueError(f"tokens [{start}, {end}) of {request_id} are already stored")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if not self._make_room(nbytes):
            return None
        entry = Entry(request_id, start, end, torch.empty(shape, dtype=dtype), pinned)
        self._insert(entry)
        return entry

    def commit(self, entry: Entry) -> bool:
        """Mark a reserved entry readable; False when it was freed meanwhile (its data is then dropped)."""
        if self._entries.get(entry.key) is not entry:
            return False
        entry.ready = True
        self._entries.move_to_end(entry.key)
        return True

    def put(self, request_id: str, start: int, end: int, tensor: torch.Tensor, pinned: bool = True) -> bool:
        """Store `tensor` (not copied) as tokens [start, end) of `request_id`; False when it cannot fit."""
        check_kv_shape(tuple(tensor.shape), start, end)
        if (request_id, start, end) in self._entries:
            raise ValueError(f"tokens [{start}, {end}) of {request_id} are already stored")
        if not self._make_room(tensor.numel() * tensor.element_size()):
            return False
        self._insert(Entry(request_id, start, end, tensor, pinned, ready=True))
        return True

    # ---- reading ----

    def lookup(self, request_id: str, start: int, end: int) -> tuple[torch.Tensor, list[Entry]] | None:
        """Tokens [start, end) of `request_id` from ready entries (a view when one entry covers them), and
        the entries read; None unless ready entries cover the whole range. Touches them for LRU."""
        if not 0 <= start < end:
            raise ValueError(f"token range [{start}, {end}) is empty or negative")
        ready = [e for e in self._by_request.get(request_id, {}).values() if e.ready]
        pieces: list[torch.Tensor] = []
        used: list[Entry] = []
        pos = start
        while pos < end:
            covering = [e for e in ready if e.start <= pos < e.end]
            if not covering:
                return None
            e = max(covering, key=lambda c: c.end)
            stop = min(end, e.end)
            pieces.append(e.tensor.narrow(TOKEN_DIM, pos - e.start, stop - pos))
            used.append(e)
            pos = stop
        first = pieces[0]
        layout = (first.dtype, first.shape[:TOKEN_DIM], first.shape[TOKEN_DIM + 1 :])
        if any((p.dtype, p.shape[:TOKEN_DIM], p.shape[TOKEN_DIM + 1 :]) != layout for p in pieces):
            return None  # adjacent entries of different layouts cannot be joined
        for e in used:
            self._entries.move_to_end(e.key)
        return (first if len(pieces) == 1 else torch.cat(pieces, dim=TOKEN_DIM)), used

    def get(self, request_id: str, start: int, end: int) -> torch.Tensor | None:
        found = self.lookup(request_id, start, end)
        return None if found is None else found[0]

    def has_pending(self, request_id: str, start: int, end: int) -> bool:
        """Whether a reserved (still receiving) entry of the request overlaps [start, end)."""
        return any(
            not e.ready and e.start < end and start < e.end for e in self._by_request.get(request_id, {}).values()
        )

    # ---- freeing ----

    def discard(self, entry: Entry) -> int:
        """Remove this entry if it is still stored; bytes freed."""
        if self._entries.get(entry.key) is not entry:
            return 0
        self._remove(entry)
        return entry.nbytes

    def free(self, request_id: str) -> int:
        """Remove every entry of the request (reserved ones too); bytes freed."""
        freed = 0
        for entry in list(self._by_request.get(request_id, {}).values()):
            freed += entry.nbytes
            self._remove(entry)
        return freed

    def stats(self) -> StoreStats:
        return StoreStats(
            bytes_total=self.budget_bytes,
            bytes_used=self.bytes_used,
            num_entries=len(self._entries),
            evictions=self.evictions,
            requests={rid: sum(e.nbytes for e in entries.values()) for rid, entries in self._by_request.items()},
        )

    def can_fit(self, nbytes: int) -> bool:
        """Whether `nbytes` more would fit after evicting every unpinned ready entry."""
        evictable = sum(e.nbytes for e in self._entries.values() if e.ready and not e.pinned)
        return self.bytes_used - evictable + nbytes <= self.budget_bytes

    # ---- internals ----

    def _make_room(self, nbytes: int) -> bool:
        if not self.can_fit(nbytes):
            return False
        for entry in list(self._entries.values()):
            if self.bytes_used + nbytes <= self.budget_bytes:
                break
            if entry.ready and not entry.pinned:
                self._remove(entry)
                self.evictions += 1
        assert self.bytes_used + nbytes <= self.budget_bytes
        return True

    def _insert(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._by_request.setdefault(entry.request_id, {})[entry.key] = entry
        self.bytes_used += entry.nbytes

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.key]
        entries = self._by_request[entry.request_id]
        del entries[entry.key]
        if not entries:
            del self._by_request[entry.request_id]
        self.bytes_used -= entry.nbytes
