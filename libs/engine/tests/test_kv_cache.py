import random

import pytest

from spindle_engine.kv_cache import BlockAllocator, OutOfBlocksError


def test_allocate_grow_free_keeps_invariants():
    a = BlockAllocator(num_blocks=10, block_size=4)
    t1: list[int] = []
    a.allocate("r1", 5, t1)
    assert len(t1) == 2 and a.num_free == 8
    a.allocate("r1", 8, t1)  # still fits in 2 blocks
    assert len(t1) == 2
    a.allocate("r1", 9, t1)
    assert len(t1) == 3
    a.check_invariants()
    a.free("r1", t1)
    assert t1 == [] and a.num_free == 10 and a.num_used == 0
    a.check_invariants()


def test_out_of_blocks_changes_nothing():
    a = BlockAllocator(num_blocks=3, block_size=4)
    t: list[int] = []
    with pytest.raises(OutOfBlocksError):
        a.allocate("r", 13, t)
    assert t == [] and a.num_free == 3


def test_double_free_and_foreign_free_are_caught():
    a = BlockAllocator(num_blocks=4, block_size=2)
    t1: list[int] = []
    t2: list[int] = []
    a.allocate("a", 3, t1)
    a.allocate("b", 1, t2)
    with pytest.raises(AssertionError):
        a.free("a", list(t2))  # b's block freed by a
    stale = list(t1)
    a.free("a", t1)
    with pytest.raises(AssertionError):
        a.free("a", stale)


def test_random_workload_never_leaks():
    rng = random.Random(0)
    a = BlockAllocator(num_blocks=64, block_size=16)
    tables: dict[str, list[int]] = {}
    lengths: dict[str, int] = {}
    for step in range(2000):
        if tables and rng.random() < 0.3:
            rid = rng.choice(list(tables))
            a.free(rid, tables.pop(rid))
            lengths.pop(rid)
        else:
            rid = rng.choice([f"r{i}" for i in range(12)])
            n = lengths.get(rid, 0) + rng.randint(1, 40)
            table = tables.setdefault(rid, [])
            if a.can_allocate(n, table):
                a.allocate(rid, n, table)
                lengths[rid] = n
            elif not table:
                tables.pop(rid)
        if step % 50 == 0:
            a.check_invariants()
            owned = [b for t in tables.values() for b in t]
            assert len(owned) == len(set(owned)) == a.num_used
    for rid, t in tables.items():
        a.free(rid, t)
    a.check_invariants()
    assert a.num_free == 64
