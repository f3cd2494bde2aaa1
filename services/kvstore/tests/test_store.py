import pytest
import torch

from spindle_kvstore import KVStore

LAYERS, HEADS, DIM = 3, 2, 4
TOKEN_BYTES = 2 * LAYERS * HEADS * DIM * 4  # float32


def kv(tokens: int, fill: float | None = None, offset: int = 0) -> torch.Tensor:
    if fill is not None:
        return torch.full((2, LAYERS, tokens, HEADS, DIM), fill)
    t = torch.arange(offset, offset + tokens, dtype=torch.float32).view(1, 1, tokens, 1, 1)
    return t.expand(2, LAYERS, tokens, HEADS, DIM).contiguous()


def test_put_get_free_and_stats() -> None:
    store = KVStore(100 * TOKEN_BYTES)
    a = kv(10)
    assert store.put("r1", 0, 10, a)
    assert store.put("r2", 0, 5, kv(5, 1.0))
    assert torch.equal(store.get("r1", 0, 10), a)
    stats = store.stats()
    assert stats.bytes_used == 15 * TOKEN_BYTES and stats.requests == {"r1": 10 * TOKEN_BYTES, "r2": 5 * TOKEN_BYTES}
    assert store.free("r1") == 10 * TOKEN_BYTES
    assert store.get("r1", 0, 10) is None and store.free("r1") == 0
    assert store.free("r2") == 5 * TOKEN_BYTES
    assert store.stats().bytes_used == 0 and store.stats().requests == {} and store.stats().num_entries == 0


def test_sub_range_and_spanning_gets() -> None:
    store = KVStore(100 * TOKEN_BYTES)
    store.put("r", 0, 8, kv(8))
    store.put("r", 8, 20, kv(12, offset=8))
    assert torch.equal(store.get("r", 3, 7), kv(4, offset=3))
    assert store.get("r", 3, 7).data_ptr() == store.get("r", 0, 8).data_ptr() + 3 * HEADS * DIM * 4  # a view
    assert torch.equal(store.get("r", 5, 17), kv(12, offset=5))  # across two entries
    assert torch.equal(store.get("r", 0, 20), kv(20))
    assert store.get("r", 15, 21) is None  # past the end
    assert store.get("other", 0, 1) is None
    with pytest.raises(ValueError):
        store.get("r", 5, 5)


def test_budget_refuses_without_evicting_pinned() -> None:
    store = KVStore(10 * TOKEN_BYTES)
    assert store.put("pinned", 0, 6, kv(6), pinned=True)
    assert not store.put("big", 0, 5, kv(5), pinned=True)  # 6 + 5 > 10 and nothing is evictable
    assert store.get("pinned", 0, 6) is not None
    assert not store.put("huge", 0, 11, kv(11), pinned=False)  # larger than the whole budget
    assert store.stats().bytes_used == 6 * TOKEN_BYTES and store.stats().evictions == 0


def test_lru_evicts_unpinned_only_least_recently_used_first() -> None:
    store = KVStore(10 * TOKEN_BYTES)
    assert store.put("a", 0, 3, kv(3), pinned=False)
    assert store.put("p", 0, 3, kv(3), pinned=True)
    assert store.put("b", 0, 3, kv(3), pinned=False)
    store.get("a", 0, 3)  # a is now more recent than b
    assert store.put("c", 0, 3, kv(3), pinned=False)  # needs 2 more tokens: evicts b only
    assert store.get("b", 0, 3) is None and store.get("a", 0, 3) is not None and store.get("p", 0, 3) is not None
    assert store.stats().evictions == 1
    assert store.put("d", 0, 7, kv(7), pinned=True)  # evicts a and c, never p
    assert set(store.stats().requests) == {"p", "d"}
    assert not store.can_fit(1)


def test_reserve_commit_discard() -> None:
    store = KVStore(10 * TOKEN_BYTES)
    entry = store.reserve("r", 0, 4, torch.bfloat16, [2, LAYERS, 4, HEADS, DIM])
    assert entry is not None and entry.tensor.dtype == torch.bfloat16
    assert store.stats().bytes_used == 4 * TOKEN_BYTES // 2
    assert store.get("r", 0, 4) is None and store.has_pending("r", 1, 2)  # not readable until committed
    entry.tensor.fill_(3.0)
    assert store.commit(entry) and not store.has_pending("r", 0, 4)
    assert torch.equal(store.get("r", 0, 4), entry.tensor)
    # a reserved entry freed before its data arrived is not resurrected by the commit
    late = store.reserve("s", 0, 2, torch.float32, [2, LAYERS, 2, HEADS, DIM], pinned=False)
    assert late is not None
    assert store.free("s") == 2 * TOKEN_BYTES
    assert not store.commit(late) and store.get("s", 0, 2) is None
    assert store.discard(late) == 0
    assert store.discard(entry) == 4 * TOKEN_BYTES // 2 and store.stats().bytes_used == 0


def test_reserved_entries_are_never_evicted() -> None:
    store = KVStore(10 * TOKEN_BYTES)
    assert store.reserve("r", 0, 6, torch.float32, [2, LAYERS, 6, HEADS, DIM], pinned=False) is not None
    assert store.reserve("s", 0, 6, torch.float32, [2, LAYERS, 6, HEADS, DIM], pinned=False) is None


def test_bad_input() -> None:
    store = KVStore(10 * TOKEN_BYTES)
    with pytest.raises(ValueError):
        store.put("r", 0, 4, kv(3))  # range and tokens disagree
    with pytest.raises(ValueError):
        store.put("r", 4, 4, kv(0))
    with pytest.raises(ValueError):
        store.put("r", 0, 2, torch.zeros(3, LAYERS, 2, HEADS, DIM))
    store.put("r", 0, 2, kv(2))
    with pytest.raises(ValueError):
        store.put("r", 0, 2, kv(2))  # already stored
    with pytest.raises(ValueError):
        KVStore(0)
