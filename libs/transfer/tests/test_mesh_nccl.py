"""NCCL pairs in the mesh (pairs.py): the choice, and two real members (`nccl_member.py`, separate processes).

This machine has no GPU, so the members that form NCCL pairs here use a fake NCCL factory (a gloo group standing in
for NCCL, placements that claim cuda:0 and cuda:1, which nothing checks); the real NCCL pair runs only with two
CUDA devices (`test_a_real_nccl_pair_between_two_gpus`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spindle_attention.distributed import staging as p2p_staging
from spindle_transfer import pairs
from spindle_transfer.mesh import Mesh
from spindle_transfer.pairs import Channel, Pair, default_factories, gloo_group, pair_transport
from spindle_transfer.paths import GLOO, HOST_STAGED, NCCL, Placement
from spindle_transfer.testing import free_port

MEMBER = str(Path(__file__).with_name("nccl_member.py"))
CPU, GPU0, GPU1 = Placement("a"), Placement("a", "cuda:0"), Placement("a", "cuda:1")
CONTROL_SIZES = {13 * 8, 2 * 8}  # the data plane's header and signal words
PAYLOADS = {0: {8448, 300}, 1: {320}}  # what each rank sends by the data plane (nccl_member.A, B; C)


@pytest.mark.parametrize(
    "a, b, nccl, want",
    [
        (GPU0, GPU1, True, NCCL),
        (GPU0, Placement("b", "cuda:0"), True, NCCL),  # the same index on another host is another GPU
        (GPU0, GPU1, False, HOST_STAGED),  # NCCL not available (or not agreed)
        (GPU0, GPU0, True, HOST_STAGED),  # one GPU: NCCL cannot
        (CPU, GPU0, True, HOST_STAGED),
        (CPU, Placement("b"), True, GLOO),
    ],
)
def test_pair_transport(a: Placement, b: Placement, nccl: bool, want: str) -> None:
    assert pair_transport(a, b, nccl) == pair_transport(b, a, nccl) == want


def test_only_a_process_on_a_gpu_with_nccl_gets_the_nccl_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(default_factories(CPU)) == {GLOO}
    if not pairs.nccl_available():  # this machine: a placement may claim a GPU, nothing asks CUDA for it
        assert set(default_factories(GPU0)) == {GLOO}
    monkeypatch.setattr(pairs, "nccl_available", lambda: True)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert set(default_factories(CPU)) == {GLOO}
    assert set(default_factories(GPU0)) == {GLOO, NCCL}
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # a timed-out NCCL op must not end the process


def test_p2p_sends_cuda_tensors_of_an_nccl_pair_as_they_are() -> None:
    pair = Pair(NCCL, Channel(object(), torch.device("cpu")), *[Channel(object(), torch.device("cuda:1"))] * 2)
    assert pair.group is pair and p2p_staging.backend_of(pair) == "cpu:gloo,cuda:nccl"
    assert not p2p_staging.needs_staging("cuda", p2p_staging.backend_of(pair))
    assert p2p_staging.needs_staging("cuda", "gloo")  # a host-staged pair's gloo group
    gloo_only = Pair(HOST_STAGED, Channel("the gloo group", torch.device("cpu")))
    assert gloo_only.group == "the gloo group" and not gloo_only.nccl


def test_the_mesh_takes_factories_for_gloo_and_nccl_only() -> None:
    for bad in ({NCCL: gloo_group}, {GLOO: gloo_group, "cuda-ipc": gloo_group}):
        with pytest.raises(ValueError, match="factories"):
            Mesh("127.0.0.1", free_port(), 0, place=GPU0, factories=bad)


def _run(mode: str, folder: Path, timeout_s: float = 120) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    rendezvous = subprocess.Popen(
        [sys.executable, "-m", "spindle_transfer.rendezvous", "--port", str(port)], stderr=subprocess.PIPE, text=True
    )
    members: list[subprocess.Popen] = []
    try:
        assert "ready" in rendezvous.stderr.readline()  # type: ignore[union-attr]
        members = [subprocess.Popen([sys.executable, MEMBER, str(r), str(port), str(folder), mode], env=env)
                   for r in (0, 1)]  # fmt: skip
        deadline = time.monotonic() + timeout_s
        for m in members:
            m.wait(max(deadline - time.monotonic(), 1))
        assert [m.returncode for m in members] == [0, 0]
        results = {r: json.loads((folder / f"{r}.json").read_text()) for r in (0, 1)}
        return results, {r: (folder / f"log-{r}").read_text() for r in (0, 1)}
    finally:
        for p in (*members, rendezvous):
            if p.poll() is None:
                p.kill()
                p.wait()


def _transfers_intact(results: dict[int, dict[str, Any]]) -> None:
    assert results[0]["dataplane"] == {"C": True}
    assert results[1]["dataplane"] == {"A": True, "B": True, "on_device": True}
    assert results[0]["p2p"] and results[1]["p2p"]
    assert all(r["not_ready"] == {} for r in results.values())


@pytest.mark.slow
def test_an_nccl_pair_formed_through_the_nccl_factory_carries_the_payload(tmp_path: Path) -> None:
    results, logs = _run("fake", tmp_path)
    _transfers_intact(results)
    for rank, peer in ((0, 1), (1, 0)):
        r = results[rank]
        assert r["paths"] == {str(peer): NCCL} and r["fallbacks"] == 0
        assert r["asked"] == [f"cuda:{rank}"] * 2  # one NCCL group per direction, bound to this process's device
        assert (
            f"group with rank {peer} formed" in logs[rank] and f"path nccl (cuda:{rank} and cuda:{peer})" in logs[rank]
        )
        # the payloads crossed the NCCL groups (after one warm-up byte each way), and no staging copy was made ...
        assert sorted(r["nccl"]) == sorted([1, 1, *PAYLOADS[rank], *PAYLOADS[peer]])
        assert r["staging_copies"] == []
        # ... while the gloo group carried the control words and p2p's host tensors only
        assert not set(r["gloo"]) & (PAYLOADS[0] | PAYLOADS[1]) and set(r["gloo"]) >= CONTROL_SIZES


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fails", "without"])
def test_a_pair_that_cannot_form_nccl_is_host_staged_on_both_sides(mode: str, tmp_path: Path) -> None:
    """`fails`: rank 1's NCCL factory raises (rank 0's waits for it, then gives up); `without`: rank 1 has none."""
    results, logs = _run(mode, tmp_path)
    _transfers_intact(results)
    for rank, peer in ((0, 1), (1, 0)):
        r = results[rank]
        assert r["paths"] == {str(peer): HOST_STAGED} and r["fallbacks"] == 1
        assert (
            f"no NCCL pair with rank {peer}" in logs[rank] and f"host-staged (cuda:{rank} and cuda:{peer}" in logs[rank]
        )
        assert set(r["gloo"]) >= PAYLOADS[0] | PAYLOADS[1] and not set(r["nccl"]) & (PAYLOADS[0] | PAYLOADS[1])
    assert results[0]["asked"] == (["cuda:0"] if mode == "fails" else [])  # "without": not even asked
    assert results[1]["asked"] == (["cuda:1"] if mode == "fails" else [])


@pytest.mark.skipif(
    not (dist.is_nccl_available() and torch.cuda.device_count() >= 2), reason="needs NCCL and two CUDA devices"
)
def test_a_real_nccl_pair_between_two_gpus(tmp_path: Path) -> None:
    results, logs = _run("real", tmp_path)
    _transfers_intact(results)  # CUDA tensors: the data plane's on the receiver's GPU, p2p's as they are
    for rank, peer in ((0, 1), (1, 0)):
        assert results[rank]["paths"] == {str(peer): NCCL} and results[rank]["fallbacks"] == 0
        assert results[rank]["staging_copies"] == []  # GPU to GPU, never through host memory
        assert f"path nccl (cuda:{rank} and cuda:{peer})" in logs[rank]
