"""Host staging of p2p ops on gloo groups: the decision, the deferred copy, and real gloo exchanges with the
staging forced on CPU tensors (ring and Ulysses attention included); on a GPU, CUDA tensors over gloo."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from spindle_attention import attention_fwd
from spindle_attention.distributed import RankGroup, p2p, ring_attention, shard_indices, staging, ulysses_attention
from spindle_attention.distributed.testing import PairRouter, run_group, staging_check


@pytest.mark.parametrize(
    ("device_type", "backend", "expected"),
    [
        ("cpu", "gloo", False),
        ("cuda", "gloo", True),
        ("xpu", "gloo", True),
        ("cuda", "nccl", False),
        ("cpu", "nccl", False),
        ("cuda", "cpu:gloo,cuda:nccl", False),
        ("cpu", "cpu:gloo,cuda:nccl", False),
        ("cuda", "cpu:gloo", True),  # no backend of its own for the device: the CPU's gloo carries it
        ("cuda", "cpu:gloo,cuda:gloo", True),
    ],
)
def test_needs_staging(device_type: str, backend: str, expected: bool) -> None:
    assert staging.needs_staging(device_type, backend) is expected


def test_a_cpu_tensor_is_never_staged_and_costs_no_backend_lookup() -> None:
    # a group object without a backend would raise if it were looked at
    assert not staging.stages(torch.zeros(3), object())  # type: ignore[arg-type]


class _Work(dist.Work):
    """A finished (or failing) receive that wrote `data` into its buffer when waited for."""

    def __init__(self, buf: torch.Tensor, data: torch.Tensor | None) -> None:
        super().__init__()
        self.buf, self.data, self.waits = buf, data, 0

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.waits += 1
        if self.data is None:
            raise RuntimeError("Connection closed by peer")
        self.buf.copy_(self.data)
        return True


def test_staged_recv_lands_in_a_strided_tensor_once_at_wait() -> None:
    wide = torch.full((4, 10), -1.0)
    target = wide[:, 1::2]  # [4, 5], strided
    host = staging.recv_buffer(target)
    assert host.is_contiguous() and host.shape == target.shape and not host.is_pinned()
    data = torch.arange(20.0).view(4, 5)
    work = staging.StagedRecv(_Work(host, data), host, target)
    assert not work.is_completed() and bool((wide == -1).all())
    assert work.wait()
    assert work.is_completed() and torch.equal(target, data) and bool((wide[:, ::2] == -1).all())
    target.fill_(7.0)
    assert work.wait()  # waits again, copies nothing
    assert bool((target == 7).all())


def test_a_failed_staged_recv_leaves_the_tensor_untouched() -> None:
    target = torch.full((3,), -1.0)
    host = staging.recv_buffer(target)
    work = staging.StagedRecv(_Work(host, None), host, target)
    with pytest.raises(RuntimeError, match="closed by peer"):
        work.wait()
    assert not work.is_completed() and bool((target == -1).all())


def test_to_host_copies_any_layout() -> None:
    t = torch.arange(24.0).view(4, 6).t()  # [6, 4], strided
    host = staging.to_host(t)
    assert host.is_contiguous() and torch.equal(host, t) and host.data_ptr() != t.data_ptr()


def _backend_worker(rank: int, ws: int) -> None:
    router = PairRouter()
    assert staging.backend_of(None) == "gloo"
    pg, _ = router.route(1 - rank)
    assert not isinstance(pg, dist.ProcessGroup)  # a bare backend, as the Mesh's pair groups are
    assert staging.backend_of(pg) == "gloo"


def test_backend_of_registered_and_bare_gloo_groups() -> None:
    run_group(_backend_worker, 2)


@pytest.mark.parametrize("routed", [False, True], ids=["default-group", "routed"])
def test_forced_staging_over_real_gloo(routed: bool) -> None:
    run_group(staging_check, 2, "cpu", routed, True)


def _no_staging_worker(rank: int, ws: int, routed: bool) -> None:
    def fail(tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a CPU tensor on gloo was staged")

    staging.to_host = staging.recv_buffer = fail  # this forked rank only
    staging_check(rank, ws, "cpu", routed, False)


@pytest.mark.parametrize("routed", [False, True], ids=["default-group", "routed"])
def test_cpu_tensors_on_gloo_take_todays_path(routed: bool) -> None:
    run_group(_no_staging_worker, 2, routed)


HQ, HKV, D = 6, 2, 16


def _attention_worker(rank: int, ws: int, routed: bool) -> None:
    staged = {"sends": 0}
    to_host = staging.to_host

    def counting(tensor: torch.Tensor) -> torch.Tensor:
        staged["sends"] += 1
        return to_host(tensor)

    staging.to_host = counting  # this forked rank only
    staging.FORCE_FOR_TESTS = True
    if routed:
        p2p.install(PairRouter())
    n = 203
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    ref_out, ref_lse = attention_fwd(q, k, v)
    group = RankGroup(tuple(range(ws)))
    for layout in ("contiguous", "zigzag"):
        idx = shard_indices(n, ws, layout)[rank]
        for fn in (ring_attention, ulysses_attention):
            out, lse = fn(q[idx], k[idx], v[idx], q_positions=idx, k_positions=idx, group=group)
            torch.testing.assert_close(out, ref_out[idx], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse, ref_lse[:, idx], atol=1e-5, rtol=1e-5)
    assert staged["sends"] > 0


@pytest.mark.parametrize("routed", [False, True], ids=["default-group", "routed"])
def test_ring_and_ulysses_through_forced_staging(routed: bool) -> None:
    run_group(_attention_worker, 3, routed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("routed", [False, True], ids=["default-group", "routed"])
def test_cuda_tensors_over_gloo(routed: bool) -> None:
    """Two ranks on one GPU exchange CUDA tensors over gloo: the real staging path (pinned buffers, the copy on
    the caller's stream), nothing forced."""
    run_group(staging_check, 2, "cuda", routed, False, start_method="spawn")
