"""`--device` on a prefill instance: the CPU by default, a device this machine does not have refused at start."""

from __future__ import annotations

import pytest
import torch

from spindle_prefill import __main__ as prefill_main
from spindle_worker import InstanceConfig

ARGS = ["--rank", "1", "--world-size", "2", "--instance-id", "prefill-0"]


def test_the_cpu_is_the_default() -> None:
    for device in ([], ["--device", "cpu"]):
        config = InstanceConfig.from_args("prefill", prefill_main.build_parser().parse_args([*ARGS, *device]))
        assert config.device == "cpu" and config.engine.kv_cache_memory_gb == 1.0


def test_a_missing_cuda_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    with pytest.raises(SystemExit) as exit_info:
        prefill_main.main([*ARGS, "--device", missing])
    assert exit_info.value.code == 2 and f"device {missing!r} asked for" in capsys.readouterr().err
