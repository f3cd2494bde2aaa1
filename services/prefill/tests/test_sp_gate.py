"""The join gate of growing SP plans (sp_gate.py): who joins when, and the wait for the previous chunk."""

import asyncio

import pytest

from spindle_prefill.sp_gate import SPJoinGate, all_joiners, joiners_after, joins_at
from spindle_protocol.messages import SPChunkDone, SPChunkSpec

CHUNKS = [
    SPChunkSpec(start=0, end=64, members=["p1"]),
    SPChunkSpec(start=64, end=128, members=["p1", "p0"]),
    SPChunkSpec(start=128, end=300, members=["p1", "p0", "p2", "p3"]),
]


def test_who_joins_where():
    assert [joins_at(CHUNKS, m) for m in ("p1", "p0", "p2", "p3")] == [0, 1, 2, 2]
    assert joiners_after(CHUNKS, 0) == ["p0"] and joiners_after(CHUNKS, 1) == ["p2", "p3"]
    assert joiners_after(CHUNKS, 2) == [] and all_joiners(CHUNKS) == ["p0", "p2", "p3"]


def _done(chunk: int, member: str, error: str = "") -> SPChunkDone:
    return SPChunkDone(request_id="r", chunk=chunk, member=member, error=error)


def test_wait_returns_once_every_member_of_the_previous_chunk_is_done():
    async def main() -> str:
        gate = SPJoinGate()
        gate.notify(_done(1, "p1"))  # a word that arrives before the wait starts is kept
        waiter = asyncio.create_task(gate.wait("r", 1, {"p0", "p1"}, lambda: False, 1.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        gate.notify(_done(0, "p0"))  # another chunk: not enough
        await asyncio.sleep(0.05)
        assert not waiter.done()
        gate.notify(_done(1, "p0"))
        return await asyncio.wait_for(waiter, 1.0)

    assert asyncio.run(main()) == ""


def test_a_member_giving_up_releases_the_waiters_with_its_reason():
    async def main() -> str:
        gate = SPJoinGate()
        waiter = asyncio.create_task(gate.wait("r", 0, {"p1"}, lambda: False, 1.0))
        await asyncio.sleep(0.05)
        gate.notify(_done(-1, "p1", error="peer died"))
        return await asyncio.wait_for(waiter, 1.0)

    assert "p1: peer died" in asyncio.run(main())


@pytest.mark.parametrize("grace", [0.0, 0.3])
def test_after_an_abort_the_wait_gives_up_after_the_grace(grace):
    async def main() -> tuple[str, float]:
        gate = SPJoinGate()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        why = await asyncio.wait_for(gate.wait("r", 0, {"p1"}, lambda: True, grace), 5.0)
        return why, loop.time() - t0

    why, took = asyncio.run(main())
    assert "aborted while waiting for ['p1'] to finish chunk 0" in why
    assert took >= grace
