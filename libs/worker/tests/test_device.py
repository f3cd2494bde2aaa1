"""An instance's device flags (spindle_worker.device): parsing, the check at start, and the KV pool's size on CUDA
from the device's free memory (the CUDA branch runs here with `torch.cuda.mem_get_info` stubbed)."""

from __future__ import annotations

import argparse

import pytest
import torch

from spindle_protocol import service
from spindle_worker import InstanceConfig, device
from spindle_worker.device import (
    CUDA_RESERVE_BYTES,
    DEFAULT_KV_MEMORY_FRACTION,
    add_device_args,
    cuda_kv_cache_bytes,
    kv_cache_memory_gb,
)
from spindle_worker.follower_args import follower_engine_config, follower_parser
from spindle_worker.instance import engine_config_from_args

GIB = 2**30
CUDA = torch.cuda.is_available()


def parser(cpu_gb: float | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    service.add_worker_args(p, "prefill")
    service.add_engine_args(p)
    add_device_args(p, cpu_gb)
    service.add_common_args(p)
    return p


def parse(*argv: str, cpu_gb: float | None = None) -> argparse.Namespace:
    return parser(cpu_gb).parse_args(["--rank", "0", "--world-size", "1", *argv])


def test_defaults_keep_the_cpu_engine_as_it_was() -> None:
    args = parse()
    assert args.device == "cpu" and args.kv_memory_fraction == DEFAULT_KV_MEMORY_FRACTION
    engine = engine_config_from_args(args)
    assert engine.device == "cpu" and engine.kv_cache_memory_gb == 1.0  # add_engine_args's default
    assert engine_config_from_args(parse("--device", "cpu")) == engine
    assert engine_config_from_args(parse(cpu_gb=2.0)).kv_cache_memory_gb == 2.0  # a role's own default (elastic)
    assert engine_config_from_args(parse("--kv-cache-memory-gb", "0.25")).kv_cache_memory_gb == 0.25


def test_instance_config_carries_the_device() -> None:
    config = InstanceConfig.from_args("prefill", parse("--device", "cpu", "--instance-id", "prefill-0"))
    assert config.device == "cpu" and config.engine.device == "cpu"


def test_a_decode_instance_captures_its_decode_graphs_at_start() -> None:
    # a burst of new batch sizes must not wait on captures; a prefill instance never runs decode steps
    args = parse("--device", "cpu", "--instance-id", "x-0")
    assert InstanceConfig.from_args("decode", args).engine.cuda_graphs_at_start
    assert not InstanceConfig.from_args("prefill", args).engine.cuda_graphs_at_start


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:-1", "tpu:0", ""])
def test_a_malformed_device_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="device must be"):
        engine_config_from_args(parse("--device", bad))


def test_cuda_where_there_is_none_or_past_the_devices_is_a_value_error() -> None:
    if not CUDA:
        for spec in ("cuda", "cuda:0", "cuda:3"):
            with pytest.raises(ValueError, match="CUDA is not available"):
                engine_config_from_args(parse("--device", spec))
    with pytest.raises(ValueError, match="CUDA"):
        engine_config_from_args(parse("--device", f"cuda:{torch.cuda.device_count() if CUDA else 0}"))


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.1", "x"])
def test_kv_memory_fraction_is_in_zero_one(bad: str) -> None:
    with pytest.raises(SystemExit):
        parse("--kv-memory-fraction", bad)


@pytest.mark.parametrize(
    "free, total, fraction, reserve, want",
    [
        (80 * GIB, 80 * GIB, 0.5, 2 * GIB, 40 * GIB),  # a fresh GPU: the fraction of the total
        (80 * GIB, 80 * GIB, 0.125, 2 * GIB, 10 * GIB),  # a quarter of the default: four processes share it
        (20 * GIB, 80 * GIB, 0.5, 2 * GIB, 18 * GIB),  # others hold the rest: what is free less the reserve
        (80 * GIB, 80 * GIB, 1.0, 2 * GIB, 78 * GIB),
        (3 * GIB, 4 * GIB, 0.5, 0, 2 * GIB),
    ],
)
def test_cuda_kv_cache_bytes(free: int, total: int, fraction: float, reserve: int, want: int) -> None:
    assert cuda_kv_cache_bytes(free, total, fraction, reserve) == want


def test_cuda_kv_cache_bytes_refuses_a_full_device_and_bad_figures() -> None:
    with pytest.raises(ValueError, match="no room for a KV pool"):
        cuda_kv_cache_bytes(CUDA_RESERVE_BYTES, 80 * GIB)
    for free, total, fraction, reserve in [(5, 4, 0.5, 0), (-1, 4, 0.5, 0), (0, 0, 0.5, 0), (4, 4, 0, 0),
                                           (4, 4, 1.5, 0), (4, 4, 0.5, -1), (4.0, 4, 0.5, 0)]:  # fmt: skip
        with pytest.raises(ValueError):
            cuda_kv_cache_bytes(free, total, fraction, reserve)  # type: ignore[arg-type]


def test_on_cuda_the_default_pool_comes_from_the_devices_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.device] = []

    def mem_get_info(dev: torch.device) -> tuple[int, int]:
        asked.append(dev)
        return 60 * GIB, 80 * GIB

    monkeypatch.setattr(device.torch.cuda, "mem_get_info", mem_get_info)
    gpu = torch.device("cuda", 1)
    assert kv_cache_memory_gb(parse(), gpu) == 40.0 and asked == [gpu]
    assert kv_cache_memory_gb(parse("--kv-memory-fraction", "0.25"), gpu) == 20.0
    assert kv_cache_memory_gb(parse("--kv-cache-memory-gb", "3"), gpu) == 3.0  # given: as given
    assert kv_cache_memory_gb(parse("--kv-cache-tokens", "4096"), gpu) == 1.0  # sized in tokens: unused
    assert kv_cache_memory_gb(parse(), torch.device("cpu")) == 1.0  # the CPU's default, untouched
    assert len(asked) == 2


def test_followers_take_the_device_and_exit_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    p = follower_parser("follower", "a follower", "--tp-size", "ranks", cpu_kv_cache_memory_gb=2.0)
    ranks = ["--rank", "1", "--leader-rank", "0", "--tp-size", "2", "--world-size", "2"]
    args = p.parse_args([*ranks, "--device", "cpu"])
    config = follower_engine_config(p, args)
    assert config.device == "cpu" and config.kv_cache_memory_gb == 2.0
    args = p.parse_args([*ranks, "--device", "gpu"])
    with pytest.raises(SystemExit) as exit_info:
        follower_engine_config(p, args)
    assert exit_info.value.code == 2 and "device must be" in capsys.readouterr().err
