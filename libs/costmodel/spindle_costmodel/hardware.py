"""Devices and links as data: peak FLOP/s, memory bandwidth and capacity, interconnect tiers, fitted efficiencies.

Peaks are the vendors' dense bf16 figures (fp32 for the CPU). Efficiencies are what a real kernel reaches of
them: fitted to published latencies (A100, from Tetris Table 1) or measured on the device (`bench/gpu_ops.py`
on an H100, `spindle profile` on this CPU). Where neither exists a preset borrows the efficiencies of its
closest measured sibling and says so in `source`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

GB = 1e9


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value}")


def _non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a non-negative finite number, got {value}")


@dataclass(frozen=True)
class Link:
    """One interconnect tier, per GPU and direction: seconds = latency_s + bytes / bandwidth."""

    name: str
    bandwidth: float  # bytes/s
    latency_s: float

    def __post_init__(self) -> None:
        _positive(f"link {self.name} bandwidth", self.bandwidth)
        _non_negative(f"link {self.name} latency_s", self.latency_s)

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a real kernel reaches, and the fixed costs a roofline leaves out."""

    gemm: float = 0.75  # of peak FLOP/s, large GEMMs
    attention: float = 0.6  # of peak FLOP/s, flash-attention prefill
    memory: float = 0.9  # of memory bandwidth, streaming reads (weights in decode, KV)
    kernel_s: float = 6e-6  # per kernel: launch tail and ramp-up (CUDA graphs on for decode)
    iteration_s: float = 0.0  # per model iteration: scheduling, sampling, framework
    ring_step_s: float = 0.0  # per SP ring step per layer: the implementation's synchronisation
    kv_memory: float | None = None  # of memory bandwidth, decode attention's KV reads (paged); None: as `memory`
    overlap: float = 1.0  # 1: a kernel hides the smaller of its compute and memory time (max); 0: it adds them

    def __post_init__(self) -> None:
        for name in ("gemm", "attention", "memory", "kv_memory"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 < value <= 1):
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")
        for name in ("kernel_s", "iteration_s", "ring_step_s"):
            _non_negative(name, getattr(self, name))


@dataclass(frozen=True)
class Hardware:
    """One device type and the cluster tiers it is sold in."""

    name: str
    peak_flops: float  # dense, in the model's dtype (bf16 on GPUs)
    mem_bandwidth: float  # bytes/s
    mem_bytes: float
    gpus_per_node: int
    intra: Link  # within a node (NVLink / NVSwitch, or PCIe)
    inter: Link  # across nodes (InfiniBand / RoCE)
    host: Link  # device <-> host memory (PCIe): swaps, CPU KV tiers, weight reloads
    host_mem_bytes: float = 1e12
    eff: Efficiency = field(default_factory=Efficiency)
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bandwidth", "mem_bytes", "host_mem_bytes"):
            _positive(name, getattr(self, name))
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def link(self, spans_nodes: bool) -> Link:
        return self.inter if spans_nodes else self.intra

    def with_efficiency(self, **changes: float) -> Hardware:
        return replace(self, eff=replace(self.eff, **changes))


NVLINK3 = Link("nvlink3", 300 * GB, 1.5e-6)  # A100 SXM: 600 GB/s bidirectional
NVLINK4 = Link("nvlink4", 450 * GB, 1.2e-6)  # H100/H200 SXM: 900 GB/s bidirectional
PCIE4 = Link("pcie4", 25 * GB, 10e-6)  # x16, what a copy reaches of its 32 GB/s
PCIE4_X8 = Link("pcie4x8", 16 * GB, 10e-6)  # Seesaw's L4 servers: 16 GiB/s per GPU
PCIE5 = Link("pcie5", 55 * GB, 10e-6)  # measured 54.9 GB/s pinned host <-> H100
IB200 = Link("ib200", 200 / 8 * GB, 10e-6)  # 200 Gb/s HDR per GPU (Tetris' cluster)
IB400 = Link("ib400", 400 / 8 * GB, 8e-6)  # 400 Gb/s NDR per GPU (DGX H100)
EFA_P4D = Link("efa-p4d", 400 / 8 / 8 * GB, 15e-6)  # AWS p4d: 400 Gb/s EFA per 8-GPU server, 50 Gb/s per GPU
ETH100 = Link("eth100", 100 / 8 * GB, 20e-6)  # cloud L4 / A10 nodes

# gemm, attention and ring_step_s fitted to Tetris Table 1 (Llama-3-8B prefill, SP 1-16 over NVLink + 200 Gb/s
# IB): 3.7 % mean, <= 15 % worst error per SP size (tests/test_calibration.py). ring_step_s is the paper's
# per-step synchronisation, what makes its a_s grow with SP size. memory, kernel_s and iteration_s are not
# identifiable from prefill latencies: memory and iteration_s are set near the H100's measured values, kernel_s
# (3 us, CUDA graphs) between what Tetris Fig. 2's TP and its SP decode ratios ask for.
A100_EFF = Efficiency(gemm=0.812, attention=0.660, memory=0.85, kernel_s=3e-6, iteration_s=1e-3, ring_step_s=6.56e-4)
# Measured on an H100 80GB HBM3 with `bench/gpu_ops.py` (bench/results/gpu_ops_h100.json): GEMMs 750-790 TFLOP/s,
# flash attention 610-625 TFLOP/s at >= 32k tokens, KV reads 3.05 TB/s, a layer's kernels ~6 us each in a graph.
H100_EFF = Efficiency(gemm=0.77, attention=0.62, memory=0.91, kernel_s=6e-6, iteration_s=0.0, ring_step_s=0.0)

# fmt: off
HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    #        name             peak FLOP/s  HBM B/s  HBM   GPUs/node; links in node, across, to host; host memory
    Hardware("a100-80g",      312e12, 2.039e12, 80 * GB,  8, NVLINK3, IB200, PCIE4, 1e12, A100_EFF,
             "A100-SXM4-80GB; efficiencies fitted to Tetris Table 1"),
    Hardware("a100-40g",      312e12, 1.555e12, 40 * GB,  8, NVLINK3, IB200, PCIE4, 1e12, A100_EFF,
             "A100-SXM4-40GB; efficiencies of a100-80g"),
    Hardware("a100-40g-p4d",  312e12, 1.555e12, 40 * GB,  8, NVLINK3, EFA_P4D, PCIE4, 1152 * GB, A100_EFF,
             "AWS p4d.24xlarge: 8 A100-SXM4-40GB, 400 Gb/s EFA per server (CSPS's cluster); efficiencies of a100-80g"),
    Hardware("a100-80g-pcie", 312e12, 1.935e12, 80 * GB,  8, PCIE4, IB200, PCIE4, 1e12, A100_EFF,
             "A100-PCIe-80GB, GPUs talk over PCIe 4.0 (Seesaw's setting); efficiencies of a100-80g"),
    Hardware("h100-sxm",      989e12, 3.35e12,  80 * GB,  8, NVLINK4, IB400, PCIE5, 2e12, H100_EFF,
             "H100-SXM5-80GB (DGX H100); efficiencies measured with bench/gpu_ops.py"),
    Hardware("h200",          989e12, 4.8e12,  141 * GB,  8, NVLINK4, IB400, PCIE5, 2e12, H100_EFF,
             "H200-SXM-141GB; efficiencies of h100-sxm"),
    Hardware("l4",            121e12, 300 * GB,  24 * GB, 8, PCIE4_X8, ETH100, PCIE4, 5e11, A100_EFF,
             "L4 24GB, GPUs over PCIe 4.0 x8 (Seesaw's 8xL4); efficiencies of a100-80g"),
    Hardware("a10",           125e12, 600 * GB,  24 * GB, 8, PCIE4_X8, ETH100, PCIE4_X8, 5e11, A100_EFF,
             "A10G 24GB, 8 per AWS g5.48xlarge over PCIe 4.0 x8 (Seesaw's 8xA10); efficiencies of a100-80g"),
)}
# fmt: on

# This machine's 2 cores run the engine in fp32: peak and bandwidth as a torch matmul and a copy measure them;
# the efficiencies of this preset are placeholders that `spindle profile` replaces by a fit to the real engine.
# fmt: off
CPU = Hardware("cpu", 180e9, 16 * GB, 24 * GB, 1, Link("gloo", 2 * GB, 2e-4), Link("gloo", 2 * GB, 2e-4),
               Link("memcpy", 8 * GB, 1e-6), 24 * GB,
               Efficiency(gemm=0.6, attention=0.3, memory=0.6, kernel_s=2e-5, iteration_s=2e-3, ring_step_s=1e-4),
               "this machine (2 cores, fp32); fit with `spindle profile`")
# fmt: on


def hardware_names() -> list[str]:
    return [*HARDWARE, "cpu"]


def get_hardware(name: str) -> Hardware:
    """A preset by name, or a JSON file: a `spindle profile` output (its fitted `device`) or a hardware dict.
    `cpu` alone is this machine's uncalibrated default: prefer a profile's fit."""
    if name == "cpu":
        return CPU
    if name in HARDWARE:
        return HARDWARE[name]
    if name.endswith(".json") and Path(name).is_file():
        try:
            data = json.loads(Path(name).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read hardware from {name}: {e}") from e
        if isinstance(data, dict) and "device" in data:
            return hardware_from_dict(data["device"]["hardware"])
        if isinstance(data, dict) and "eff" in data:
            return hardware_from_dict(data)
        raise ValueError(f"{name} has no fitted device: run `spindle profile` again (it writes one)")
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())} or a `spindle profile` JSON")


def hardware_to_dict(hw: Hardware) -> dict[str, Any]:
    return asdict(hw)


def hardware_from_dict(data: dict[str, Any]) -> Hardware:
    """The inverse of `hardware_to_dict` (e.g. the `cpu` device a `spindle profile` fitted)."""
    try:
        links = {k: Link(**data[k]) for k in ("intra", "inter", "host")}
        eff = Efficiency(**data["eff"])
        rest = {k: v for k, v in data.items() if k not in (*links, "eff")}
        return Hardware(**rest, **links, eff=eff)
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a hardware description: {e}") from e
