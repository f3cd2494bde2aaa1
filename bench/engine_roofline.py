"""What this machine allows at best, for `bench_engine.py`: memory bandwidth and GEMM throughput measured here,
and the tokens/s they cap Spindle at (decode at batch 1 reads every weight once per token; prefill is bound by
GEMM throughput). Ratios against transformers above these ceilings cannot be reached on this machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from spindle_attention import cpu
from spindle_model import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _median_s(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth_gb_s(mib: int = 512) -> float:
    """Streaming read bandwidth (a sum over a buffer far larger than the caches), all torch threads."""
    buf = torch.ones(mib * 2**20 // 4)
    return buf.numel() * 4 / _median_s(buf.sum) / 1e9


def gemm_gflop_s(dtype: torch.dtype, m: int = 2048, k: int = 576, n: int = 1536) -> float:
    """torch's GEMM at a prefill-like shape (SmolLM2's MLP)."""
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    return 2 * m * k * n / _median_s(lambda: torch.nn.functional.linear(x, w)) / 1e9


def weight_params_per_token(cfg: ModelConfig) -> int:
    """Weights a decode step reads once per batch: every layer's projections and MLP, and the LM head."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + cfg.vocab_size * h


def prefill_flops_per_token(cfg: ModelConfig, tokens: int) -> float:
    """GEMM FLOPs per prompt token plus causal attention's (QK and PV over the mean context tokens/2)."""
    lm_head = cfg.vocab_size * cfg.hidden_size  # one row of logits per prompt
    gemm = 2 * (weight_params_per_token(cfg) - lm_head) + 2 * lm_head / tokens
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens / 2
    return gemm + attention


def roofline(
    cfg: ModelConfig, dtypes: list[str], measured: dict[str, Any], gguf_bytes: int | None = None
) -> dict[str, Any]:
    """`gguf_bytes`: bytes a decode step reads when float32 matmuls take the GGUF file's blocks (None: not used)."""
    bandwidth = read_bandwidth_gb_s()
    params = weight_params_per_token(cfg)
    out: dict[str, Any] = {
        "cpu_kernels": cpu.available(),
        "read_bandwidth_gb_s": bandwidth,
        "weight_params": params,
        "decode_b1_ceiling_tok_s": {},
        "prefill_ceiling_tok_s": {},
        "gemm_gflop_s": {},
    }
    hf_b1 = next((r["transformers_tok_s"] for r in measured["decode"] if r["batch"] == 1), None)
    for name in dtypes:
        dtype = DTYPES[name]
        ceiling = bandwidth * 1e9 / (params * dtype.itemsize)
        out["decode_b1_ceiling_tok_s"][name] = ceiling
        gflops = gemm_gflop_s(dtype)
        out["gemm_gflop_s"][name] = gflops
        out["prefill_ceiling_tok_s"][name] = {
            str(r["tokens"]): gflops * 1e9 / prefill_flops_per_token(cfg, r["tokens"]) for r in measured["prefill"]
        }
    if gguf_bytes:
        out["gguf_weight_bytes"] = gguf_bytes
        out["decode_b1_ceiling_tok_s"]["float32+gguf"] = bandwidth * 1e9 / gguf_bytes
    if hf_b1:
        best = max(out["decode_b1_ceiling_tok_s"].values())
        out["decode_b1_ceiling_ratio"] = best / hf_b1
    hf_prefill = {str(r["tokens"]): r["transformers_tok_s"] for r in measured["prefill"] if r["transformers_tok_s"]}
    out["prefill_ceiling_ratio"] = {
        t: max(out["prefill_ceiling_tok_s"][d][t] for d in dtypes) / hf for t, hf in hf_prefill.items()
    }
    return out


def format_roofline(r: dict[str, Any]) -> str:
    lines = [
        f"this machine's ceilings (CPU kernels {'on' if r['cpu_kernels'] else 'off'}): read bandwidth "
        f"{r['read_bandwidth_gb_s']:.1f} GB/s, {r['weight_params'] / 1e6:.1f} M weights read per decode step",
    ]
    for name, tok_s in r["decode_b1_ceiling_tok_s"].items():
        if name not in r["gemm_gflop_s"]:  # float32 computing from GGUF blocks: only the bytes read change
            lines.append(f"  {name}: decode batch 1 <= {tok_s:.1f} tok/s ({r['gguf_weight_bytes'] / 1e6:.0f} MB read)")
            continue
        prefill = ", ".join(f"{t}: {v:.0f}" for t, v in r["prefill_ceiling_tok_s"][name].items())
        lines.append(
            f"  {name}: decode batch 1 <= {tok_s:.1f} tok/s (weights / bandwidth); GEMM {r['gemm_gflop_s'][name]:.0f} "
            f"GFLOP/s -> prefill <= {prefill} tok/s"
        )
    if "decode_b1_ceiling_ratio" in r:
        lines.append(f"  best possible ratio vs transformers: decode batch 1 {r['decode_b1_ceiling_ratio']:.2f}x")
    for t, ratio in r["prefill_ceiling_ratio"].items():
        lines.append(f"  best possible ratio vs transformers: prefill {t} tokens {ratio:.2f}x")
    return "\n".join(lines)
