"""Staging between a tensor's device and the wire's (staging.py), with the device a parameter: on a CPU-only
machine the `cuda` cases skip and the CPU cases check that nothing is copied; on a GPU they check the copies."""

from __future__ import annotations

import pytest
import torch

from spindle_transfer import staging
from spindle_transfer.staging import can_pin, check_landing, host_buffer, land, receive_buffer, staged, to_wire

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))]
HOST = torch.device("cpu")


def kv(device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 5, 2, 4, generator=g).to(device)


def test_staged_compares_devices_without_needing_them() -> None:
    assert not staged(HOST, HOST)
    assert staged(torch.device("cuda", 0), HOST) and staged(HOST, torch.device("cuda", 1))
    assert staged(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not staged(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not staged(torch.device("cuda"), torch.device("cuda", 0))  # a bare "cuda" is the current device (0 here)


def test_host_buffers_pin_only_where_the_process_can() -> None:
    buf = host_buffer((3, 4), torch.bfloat16, pin=True)
    assert buf.shape == (3, 4) and buf.dtype == torch.bfloat16 and buf.device.type == "cpu"
    assert buf.is_pinned() == can_pin()  # no CUDA: an ordinary host tensor, and no error
    assert not host_buffer((2,), torch.float32, pin=False).is_pinned()


def test_pinning_is_skipped_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "can_pin", lambda: False)
    assert not host_buffer((2, 2), torch.float32, pin=True).is_pinned()


def test_to_wire_on_the_same_device_does_not_copy() -> None:
    t = kv("cpu")
    assert to_wire(t, HOST).data_ptr() == t.data_ptr()
    strided = t.transpose(1, 2)
    out = to_wire(strided, HOST)
    assert out.is_contiguous() and torch.equal(out, strided)


@pytest.mark.parametrize("device", DEVICES)
def test_to_wire_stages_a_device_tensor_on_the_host(device: str) -> None:
    t = kv(device)
    out = to_wire(t, HOST)
    assert out.device == HOST and out.is_contiguous() and torch.equal(out, t.cpu())
    assert out.is_pinned() == (device == "cuda")
    assert (out.data_ptr() == t.data_ptr()) == (device == "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_a_received_tensor_lands_on_the_device(device: str) -> None:
    landing = torch.device(device)
    buf = receive_buffer((2, 3, 5, 2, 4), torch.float32, HOST, landing)
    assert buf.device == HOST and buf.is_pinned() == (device == "cuda")
    buf.copy_(kv("cpu"))
    got = land(buf, landing)
    assert got.device.type == device and torch.equal(got.cpu(), kv("cpu"))
    assert (got is buf) == (device == "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_a_received_tensor_lands_in_out(device: str) -> None:
    out = torch.zeros(2, 3, 5, 2, 4, device=device)
    got = land(kv("cpu"), out.device, out)
    assert got is out and torch.equal(out.cpu(), kv("cpu"))
    assert land(out, out.device, out) is out  # received straight into out: nothing more to copy


def test_check_landing() -> None:
    assert check_landing("cpu") == HOST and check_landing(HOST) == HOST
    for bad in ["gpu", "meta", 3]:
        with pytest.raises(ValueError):
            check_landing(bad)  # type: ignore[arg-type]
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA is not available"):
            check_landing("cuda:0")
    else:
        with pytest.raises(ValueError, match="CUDA devices"):
            check_landing(f"cuda:{torch.cuda.device_count()}")


def test_recv_checks_where_it_lands_before_touching_the_network() -> None:
    from spindle_protocol import header_for
    from spindle_transfer import DataPlane

    plane = DataPlane(0, 2, "gloo", max_workers=1)
    header = header_for("float32", [4, 5])
    with pytest.raises(ValueError):
        plane.recv(header, 1, 7, device="gpu")
    with pytest.raises(ValueError, match="CPU or a CUDA device"):
        plane.recv(header, 1, 7, out=torch.zeros(4, 5), device="meta")
    with pytest.raises(ValueError, match="cannot hold"):
        plane.recv(header, 1, 7, out=torch.zeros(5, 4), device="cpu")
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA is not available"):
            plane.recv(header, 1, 7, device="cuda:0")
