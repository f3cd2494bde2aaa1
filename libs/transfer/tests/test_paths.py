"""The data plane's transport per pair of ranks (paths.py) and the placements the mesh's join log carries."""

from __future__ import annotations

import pytest

from spindle_transfer.mesh import parse_entries, parse_joins
from spindle_transfer.paths import (
    CUDA_IPC,
    GLOO,
    HOST_STAGED,
    MESH_TRANSPORTS,
    NCCL,
    TRANSPORTS,
    Placement,
    candidates,
    choose_path,
    describe,
    normalize_device,
)

CPU_A, CPU_B = Placement("a"), Placement("b")
GPU0, GPU1, OTHER_HOST_GPU0 = Placement("a", "cuda:0"), Placement("a", "cuda:1"), Placement("b", "cuda:0")
ALL = frozenset(TRANSPORTS)


@pytest.mark.parametrize(
    "spec, want",
    [
        ("cpu", "cpu"),
        ("CPU", "cpu"),
        ("cuda", "cuda:0"),
        ("cuda:0", "cuda:0"),
        ("cuda:3", "cuda:3"),
        (" cuda:12", "cuda:12"),
    ],
)
def test_normalize_device(spec: str, want: str) -> None:
    assert normalize_device(spec) == want


@pytest.mark.parametrize("spec", ["", "gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "mps", "cuda:0:1", None, 0])
def test_normalize_device_refuses_other_spellings(spec: object) -> None:
    with pytest.raises(ValueError, match="device must be"):
        normalize_device(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "a, b, want",
    [
        (CPU_A, CPU_B, (GLOO,)),
        (CPU_A, CPU_A, (GLOO,)),
        (CPU_A, GPU0, (HOST_STAGED,)),
        (GPU0, GPU0, (CUDA_IPC, HOST_STAGED)),  # two processes on one GPU: NCCL cannot
        (GPU0, GPU1, (NCCL, HOST_STAGED)),
        (GPU0, OTHER_HOST_GPU0, (NCCL, HOST_STAGED)),  # the same index on another host is another GPU
    ],
)
def test_candidates_per_pair(a: Placement, b: Placement, want: tuple[str, ...]) -> None:
    assert candidates(a, b) == candidates(b, a) == want
    assert choose_path(a, b, ALL) == choose_path(b, a, ALL) == want[0]


def test_the_mesh_carries_gloo_host_staged_and_nccl_but_not_cuda_ipc() -> None:
    assert {GLOO, NCCL, HOST_STAGED} == MESH_TRANSPORTS
    assert choose_path(CPU_A, CPU_B) == GLOO
    for a, b in [(CPU_A, GPU0), (GPU0, GPU0)]:
        assert choose_path(a, b) == choose_path(b, a) == HOST_STAGED
    for a, b in [(GPU0, GPU1), (GPU0, OTHER_HOST_GPU0)]:
        assert choose_path(a, b) == choose_path(b, a) == NCCL


def test_a_same_gpu_pair_without_cuda_ipc_is_host_staged_even_with_nccl() -> None:
    assert choose_path(GPU0, GPU0, frozenset({GLOO, NCCL, HOST_STAGED})) == HOST_STAGED


def test_choose_path_errors() -> None:
    with pytest.raises(ValueError, match="no available transport"):
        choose_path(GPU0, GPU1, frozenset({GLOO}))
    with pytest.raises(ValueError, match="unknown transports"):
        choose_path(CPU_A, CPU_B, frozenset({"rdma"}))


def test_describe_names_the_choice_and_what_was_not_available() -> None:
    assert describe(CPU_A, CPU_A) == "gloo (cpu and cpu)"
    assert describe(GPU0, GPU0) == "host-staged (cuda:0 and cuda:0 on one GPU; cuda-ipc not available)"
    assert describe(GPU0, GPU1) == "nccl (cuda:0 and cuda:1)"
    assert describe(GPU0, GPU1, MESH_TRANSPORTS - {NCCL}) == "host-staged (cuda:0 and cuda:1; nccl not available)"
    assert describe(GPU0, OTHER_HOST_GPU0, ALL) == "nccl (a/cuda:0 and b/cuda:0)"


def test_placement_round_trip_and_checks() -> None:
    assert Placement.decode(GPU1.encode()) == GPU1 and GPU1.encode() == "a/cuda:1"
    assert Placement.here("cuda").device == "cuda:0" and not Placement.here().on_gpu
    for bad in ["a", "a/gpu", "/cpu", "a:b/cpu", "a;b/cpu"]:
        with pytest.raises(ValueError):
            Placement.decode(bad)
    with pytest.raises(ValueError):
        Placement("a", "cuda")  # a placement's device is normalized: cuda:N


def test_join_log_entries_with_and_without_placements() -> None:
    text = "0:t0;1:t1:h/cuda:0;2:t2:h/cpu;1:t3:h/cuda:1;3:t4:bad;2:-;"
    assert parse_entries(text) == {
        0: ("t0", None),  # an older member's entry says nothing about where it runs
        1: ("t3", Placement("h", "cuda:1")),  # the latest entry of a rank wins
        2: ("-", None),
        3: ("t4", None),  # a malformed placement is ignored, not fatal
    }
    assert parse_joins(text) == {0: "t0", 1: "t3", 2: "-", 3: "t4"}


def test_a_fixed_worlds_default_backend_follows_the_ranks_device_not_the_machine() -> None:
    # a kvstore keeps host memory on a machine with GPUs: gloo, as its CPU peers (NCCL cannot carry host tensors)
    from spindle_transfer.dataplane import fixed_world_backend

    assert fixed_world_backend(CPU_A) == "gloo"
    assert fixed_world_backend(GPU0) == "nccl" and fixed_world_backend(GPU1) == "nccl"
