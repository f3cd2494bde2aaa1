"""An instance's heartbeat (`Instance.info`) from a real instance object on a real engine (a tiny random Llama on
the CPU): it names the device the engine runs on, and survives the registry's encoding."""

from __future__ import annotations

import pytest
import torch

from spindle_engine import Engine, EngineConfig
from spindle_engine.engine_thread import EngineThread
from spindle_model import LlamaModel
from spindle_model.testing import tiny_llama
from spindle_protocol import decode, encode
from spindle_protocol.messages import InstanceInfo
from spindle_worker import Instance, InstanceConfig


class TinyInstance(Instance):
    """An instance whose engine runs a tiny model (no model files); nothing here joins NATS or a data plane."""

    def make_engine(self) -> Engine:
        hf, cpu_model = tiny_llama()
        model = LlamaModel(cpu_model.config, device=self.config.engine.torch_device)  # where the engine runs
        model.load_weights(hf.state_dict())
        return Engine(self.config.engine, model=model)


def heartbeat(device: str) -> InstanceInfo:
    engine = EngineConfig(device=device, kv_cache_tokens=512, block_size=4)
    inst = TinyInstance(InstanceConfig("prefill", "prefill-0", "nats://127.0.0.1:1", 0, 1, "tcp://127.0.0.1:1", engine))
    inst.thread = EngineThread(inst.make_engine, lambda *_: None)
    inst.engine = inst.thread.start().result(timeout=120)
    try:
        return inst.info()
    finally:
        inst.thread.stop()


def test_a_cpu_instance_reports_device_cpu_in_its_heartbeat() -> None:
    info = heartbeat("cpu")
    assert info.device == "cpu" and info.instance_id == "prefill-0" and info.kv_blocks_total == 128
    assert decode(encode(info), InstanceInfo) == info  # as the registry carries it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_instance_reports_its_device_with_the_index() -> None:
    assert heartbeat("cuda").device == "cuda:0"  # a bare "cuda" is device 0
