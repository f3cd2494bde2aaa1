"""The collectives of `comm` on a gloo process group (not a RankGroup) with host staging: `all_gather_ints`,
`all_to_all_bytes` and Ulysses attention over them give what the unstaged path gives, with the staging forced on CPU
tensors (`staging.FORCE_FOR_TESTS`); CPU tensors take today's path untouched; on a GPU, CUDA tensors over gloo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from spindle_attention.distributed import shard_indices, staging, ulysses_attention
from spindle_attention.distributed.comm import all_gather_ints, all_to_all_bytes
from spindle_attention.distributed.testing import run_group

HQ, HKV, D, TOKENS = 6, 2, 16, 41


def _send_size(src: int, dst: int) -> int:
    return (3 * src + 2 * dst) % 5  # zero for some pairs: empty parts travel too


def _byte(src: int, dst: int, i: int) -> int:
    return (31 * src + 7 * dst + i) % 256


def _collectives(rank: int, ws: int, device: torch.device) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """What this rank gets from `all_gather_ints` and `all_to_all_bytes` (checked against what every rank sent),
    and Ulysses attention's output over the default group (its lse is checked here too)."""
    gathered = all_gather_ints([rank, 10 * rank + 1, -5, 2**40 + rank], None, device, None)
    assert gathered == [[r, 10 * r + 1, -5, 2**40 + r] for r in range(ws)]

    send_sizes = [_send_size(rank, p) for p in range(ws)]
    recv_sizes = [_send_size(p, rank) for p in range(ws)]
    send = torch.tensor([_byte(rank, p, i) for p in range(ws) for i in range(send_sizes[p])], dtype=torch.uint8)
    recv = torch.full((sum(recv_sizes),), 255, dtype=torch.uint8, device=device)
    all_to_all_bytes(recv, send.to(device), recv_sizes, send_sizes, None)
    want = [_byte(p, rank, i) for p in range(ws) for i in range(recv_sizes[p])]
    assert recv.cpu().tolist() == want

    g = torch.Generator().manual_seed(TOKENS)
    q, k, v = (torch.randn(TOKENS, h, D, generator=g) for h in (HQ, HKV, HKV))
    idx = shard_indices(TOKENS, ws, "zigzag")[rank]
    out, lse = ulysses_attention(*(t[idx].to(device) for t in (q, k, v)), q_positions=idx, k_positions=idx)
    assert out.device.type == device.type and lse.shape == (HQ, len(idx))
    return gathered, recv.cpu(), torch.cat([out.cpu().flatten(), lse.cpu().flatten()])


def _counting_to_host() -> dict[str, int]:
    """Count the host copies staging makes on this (forked) rank."""
    count = {"to_host": 0}
    to_host = staging.to_host

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        count["to_host"] += 1
        return to_host(tensor)

    staging.to_host = counting
    return count


def _forced_worker(rank: int, ws: int) -> None:
    plain = _collectives(rank, ws, torch.device("cpu"))
    count = _counting_to_host()
    staging.FORCE_FOR_TESTS = True
    try:
        staged = _collectives(rank, ws, torch.device("cpu"))
    finally:
        staging.FORCE_FOR_TESTS = False
    assert count["to_host"] == 5, count  # gathers: 2 (own, Ulysses'), all-to-alls: 3 (own, Ulysses' two)
    assert plain[0] == staged[0] and torch.equal(plain[1], staged[1]) and torch.equal(plain[2], staged[2])


@pytest.mark.parametrize("ws", [2, 3])
def test_forced_staging_of_the_collectives_matches_the_unstaged_ones(ws: int) -> None:
    run_group(_forced_worker, ws)


def _cpu_worker(rank: int, ws: int) -> None:
    def fail(tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a CPU tensor on gloo was staged")

    staging.to_host = staging.recv_buffer = fail  # this forked rank only
    _collectives(rank, ws, torch.device("cpu"))


def test_cpu_tensors_on_a_gloo_group_take_todays_path() -> None:
    run_group(_cpu_worker, 3)


def device_worker(rank: int, ws: int, device: str) -> None:
    """The collectives on `device` over the gloo group, against the same calls unstaged on the CPU: on "cuda" the
    real staging (pinned buffers), on "cpu" the forced one."""
    plain = _collectives(rank, ws, torch.device("cpu"))
    staging.FORCE_FOR_TESTS = device == "cpu"
    staged = _collectives(rank, ws, torch.device(device))
    assert plain[0] == staged[0] and torch.equal(plain[1], staged[1])
    torch.testing.assert_close(staged[2], plain[2], atol=1e-4, rtol=1e-4)  # attention, maybe on another device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_through_the_collectives_over_gloo() -> None:
    # CUDA ranks are spawned, and a spawned rank finds its function by module: this file, run as a script
    done = subprocess.run([sys.executable, __file__, "cuda"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


if __name__ == "__main__":
    run_group(device_worker, 2, sys.argv[1], start_method="spawn")
