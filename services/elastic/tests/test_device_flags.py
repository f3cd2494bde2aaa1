"""`--device` on the elastic processes (the instance, pipeline stages, re-sharding members): the CPU default and the
role's own KV size (DEFAULT_KV_CACHE_GB) as before, a device this machine does not have refused at start."""

from __future__ import annotations

import pytest
import torch
from spindle_elastic import __main__ as elastic_main
from spindle_elastic import reshard_member, spp_stage
from spindle_elastic.instance import DEFAULT_KV_CACHE_GB

from spindle_worker import InstanceConfig
from spindle_worker.follower_args import follower_engine_config

MISSING = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"  # no such device here
LEADER = ["--rank", "1", "--world-size", "3", "--instance-id", "elastic-0"]
FOLLOWER = ["--rank", "2", "--leader-rank", "1", "--world-size", "3", "--instance-id", "elastic-0"]


@pytest.mark.parametrize("device", [[], ["--device", "cpu"]])
def test_the_cpu_is_the_default_and_the_role_keeps_its_kv_size(device: list[str]) -> None:
    config = InstanceConfig.from_args("elastic", elastic_main.build_parser().parse_args([*LEADER, *device]))
    assert config.device == "cpu" and config.engine.kv_cache_memory_gb == DEFAULT_KV_CACHE_GB
    for p, size in (
        (spp_stage.build_parser(), ["--spp-size", "2"]),
        (reshard_member.build_parser(), ["--reshard-size", "2", "--reshard", "PP2:TP2"]),
    ):
        engine = follower_engine_config(p, p.parse_args([*FOLLOWER, *size, *device]))
        assert engine.device == "cpu" and engine.kv_cache_memory_gb == DEFAULT_KV_CACHE_GB
    sized = elastic_main.build_parser().parse_args([*LEADER, "--kv-cache-memory-gb", "0.5", *device])
    assert InstanceConfig.from_args("elastic", sized).engine.kv_cache_memory_gb == 0.5


def test_a_missing_cuda_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as leader:
        elastic_main.main([*LEADER, "--device", MISSING])
    with pytest.raises(SystemExit) as stage:
        spp_stage.main([*FOLLOWER, "--spp-size", "2", "--device", MISSING])
    assert leader.value.code == stage.value.code == 2
    assert capsys.readouterr().err.count(f"device {MISSING!r} asked for") == 2
