"""`--device` on the decode processes (leader, TP follower, KVP follower): CPU defaults as before, a device this
machine does not have refused with a usage error before anything starts."""

from __future__ import annotations

import pytest
import torch

from spindle_decode import __main__ as decode_main
from spindle_decode import kvp_follower, tp_follower
from spindle_worker import InstanceConfig
from spindle_worker.follower_args import follower_engine_config

MISSING = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"  # no such device here
LEADER = ["--rank", "1", "--world-size", "3", "--instance-id", "decode-0"]
FOLLOWER = ["--rank", "2", "--leader-rank", "1", "--world-size", "3"]


@pytest.mark.parametrize("device", [[], ["--device", "cpu"]])
def test_the_cpu_is_the_default_and_sizes_as_before(device: list[str]) -> None:
    config = InstanceConfig.from_args("decode", decode_main.build_parser().parse_args([*LEADER, *device]))
    assert config.device == "cpu" and config.engine.kv_cache_memory_gb == 1.0
    for module, size in ((tp_follower, "--tp-size"), (kvp_follower, "--kvp-size")):
        p = module.build_parser()
        engine = follower_engine_config(p, p.parse_args([*FOLLOWER, size, "2", *device]))
        assert engine.device == "cpu" and engine.kv_cache_memory_gb == 1.0


def test_a_missing_cuda_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as leader:
        decode_main.main([*LEADER, "--device", MISSING])
    with pytest.raises(SystemExit) as follower:
        tp_follower.main([*FOLLOWER, "--tp-size", "2", "--device", MISSING])
    assert leader.value.code == follower.value.code == 2
    assert capsys.readouterr().err.count(f"device {MISSING!r} asked for") == 2
