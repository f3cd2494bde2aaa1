"""Measure one GPU's operator speeds for the cost model: GEMMs, attention, KV reads, copies, whole layers.

The cost model (`spindle_costmodel`) predicts a Llama layer as GEMMs + attention + elementwise ops, each
`max(compute, memory)` at a fitted efficiency. This script measures those efficiencies on the GPU it runs on,
with Llama-3-8B's shapes in bf16 (random weights), and times whole decoder layers (prefill and decode) as
held-out points the model must predict. Standalone: it needs only torch, so it runs on a lent GPU machine.

    python bench/gpu_ops.py --out bench/results/gpu_ops_h100.json

Prints a table per section and writes JSON: {"device": ..., "gemm": [...], "attention": [...],
"decode_attention": [...], "copy": {...}, "layer_prefill": [...], "layer_decode": [...]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336  # Llama-3-8B
GEMMS = {  # name -> (in_features, out_features)
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    "o": (HEADS * HEAD_DIM, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTER),
    "down": (INTER, HIDDEN),
}


def timed(fn: Callable[[], Any], repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of fn() on the GPU (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_gemm(tokens: list[int]) -> list[dict[str, float]]:
    rows = []
    for name, (k, n) in GEMMS.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            s = timed(lambda x=x, w=w: F.linear(x, w))
            flops, nbytes = 2.0 * m * k * n, 2.0 * (m * k + k * n + m * n)
            rows.append(
                {"op": name, "m": m, "k": k, "n": n, "s": s, "tflops": flops / s / 1e12, "gbps": nbytes / s / 1e9}
            )
    return rows


def measure_attention(lengths: list[int]) -> list[dict[str, float]]:
    """Causal prefill attention, one sequence, GQA 32/8, head_dim 128 (flash backend)."""
    rows = []
    for n in lengths:
        q = torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        s = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        flops = 4.0 * n * n / 2 * HEADS * HEAD_DIM  # QK^T and PV over the causal half
        rows.append({"tokens": n, "s": s, "tflops": flops / s / 1e12})
    return rows


def measure_chunk_attention(cases: list[tuple[int, int]]) -> list[dict[str, float]]:
    """A chunk of L new tokens over C cached ones (prefix unmasked, chunk causal): the C*L term of Tetris Eq. 1."""
    rows = []
    for hist, n in cases:
        q = torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kh = torch.randn(1, KV_HEADS, hist, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(1, KV_HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        # the history unmasked and the chunk causally, as two flash calls (their LSE merge is elementwise)
        s = timed(lambda q=q, k=kh: F.scaled_dot_product_attention(q, k, k, enable_gqa=True))
        s += timed(lambda q=q, k=kc: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
        flops = 4.0 * (hist * n + n * n / 2) * HEADS * HEAD_DIM
        rows.append({"history": hist, "tokens": n, "s": s, "tflops": flops / s / 1e12})
    return rows


def measure_decode_attention(cases: list[tuple[int, int]]) -> list[dict[str, float]]:
    """One query token per sequence over `context` cached tokens: a KV read, memory-bound."""
    rows = []
    for batch, ctx in cases:
        q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        s = timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        nbytes = 2.0 * k.numel() * 2
        rows.append({"batch": batch, "context": ctx, "s": s, "gbps": nbytes / s / 1e9})
        del k, v
    return rows


def measure_copy() -> dict[str, float]:
    x = torch.empty(2 * 1024**3, device="cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    s = timed(lambda: y.copy_(x))
    host = torch.empty(512 * 1024**2, dtype=torch.uint8).pin_memory()
    dev = torch.empty(512 * 1024**2, device="cuda", dtype=torch.uint8)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(dev, non_blocking=True))
    return {
        "d2d_gbps": 2 * x.numel() / s / 1e9,
        "h2d_gbps": host.numel() / h2d / 1e9,
        "d2h_gbps": host.numel() / d2h / 1e9,
    }


# (hidden, heads, kv_heads, head_dim, intermediate) of the cost model's presets whose layers are timed whole
SHAPES = {
    "llama3-8b": (4096, 32, 8, 128, 14336),
    "llama2-7b": (4096, 32, 32, 128, 11008),
    "codellama-34b": (8192, 64, 8, 128, 22016),
    "llama3-70b": (8192, 64, 8, 128, 28672),
}


class Layer(torch.nn.Module):
    """A Llama decoder layer (RoPE left out: elementwise, a few % of a layer), random bf16 weights."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> None:
        super().__init__()
        w = lambda n, k: torch.nn.Parameter(torch.randn(n, k, dtype=torch.bfloat16) / k**0.5)  # noqa: E731
        self.dims = (hidden, heads, kv_heads, head_dim)
        self.qkv, self.o = w((heads + 2 * kv_heads) * head_dim, hidden), w(hidden, heads * head_dim)
        self.gate_up, self.down = w(2 * inter, hidden), w(hidden, inter)
        self.n1 = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))
        self.n2 = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))

    def forward(
        self, x: torch.Tensor, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden, heads, kv_heads, hd = self.dims
        b, n, _ = x.shape  # [batch, tokens, hidden]
        h = F.rms_norm(x, (hidden,), self.n1)
        q, k, v = F.linear(h, self.qkv).split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        q = q.view(b, n, heads, hd).transpose(1, 2)
        k = k.view(b, n, kv_heads, hd).transpose(1, 2)
        v = v.view(b, n, kv_heads, hd).transpose(1, 2)
        if k_cache is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k_cache[:, :, -1:] = k
            v_cache[:, :, -1:] = v
            a = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
        x = x + F.linear(a.transpose(1, 2).reshape(b, n, -1), self.o)
        gate, up = F.linear(F.rms_norm(x, (hidden,), self.n2), self.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.down)


def measure_layers(
    shape: tuple[int, ...], prefill: list[int], decode: list[tuple[int, int]], layers: int
) -> tuple[list, list]:
    hidden, _, kv_heads, head_dim, _ = shape
    stack = torch.nn.ModuleList(Layer(*shape) for _ in range(layers)).cuda()
    pre, dec = [], []
    with torch.inference_mode():
        for n in prefill:
            x = torch.randn(1, n, hidden, device="cuda", dtype=torch.bfloat16)

            def run(x: torch.Tensor = x) -> None:
                for layer in stack:
                    layer(x)

            s = timed(run, repeats=5, warmup=2)
            pre.append({"tokens": n, "layers": layers, "s_per_layer": s / layers})
        for batch, ctx in decode:
            x = torch.randn(batch, 1, hidden, device="cuda", dtype=torch.bfloat16)
            kc = torch.randn(batch, kv_heads, ctx, head_dim, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)

            def step(x: torch.Tensor = x, kc: torch.Tensor = kc, vc: torch.Tensor = vc) -> None:
                for layer in stack:
                    layer(x, kc, vc)  # one KV cache shared by the layers: the bytes read are the same

            eager = timed(step, repeats=10, warmup=3)
            graph = torch.cuda.CUDAGraph()
            step()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                step()
            graphed = timed(graph.replay, repeats=10, warmup=3)
            dec.append(
                {
                    "batch": batch,
                    "context": ctx,
                    "layers": layers,
                    "s_per_layer": graphed / layers,
                    "eager_s_per_layer": eager / layers,
                }
            )
            del kc, vc, graph
            torch.cuda.empty_cache()
    return pre, dec


def table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n== {title}")
    if rows:
        keys = list(rows[0])
        print("  ".join(f"{k:>12}" for k in keys))
        for r in rows:
            print("  ".join(f"{v:>12.4g}" if isinstance(v, float) else f"{v!s:>12}" for v in r.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON to write")
    p.add_argument("--layers", type=int, default=4, help="decoder layers in the whole-layer timings (%(default)s)")
    p.add_argument(
        "--other-models",
        nargs="*",
        default=["llama2-7b", "codellama-34b", "llama3-70b"],
        choices=[k for k in SHAPES if k != "llama3-8b"],
        help="other shapes whose whole layers are timed (%(default)s)",
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_ops.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "model_shape": "llama3-8b (hidden 4096, 32/8 heads, head_dim 128, intermediate 14336), bf16",
    }
    doc["gemm"] = measure_gemm([1, 8, 32, 128, 512, 2048, 8192, 16384])
    table("GEMM", doc["gemm"])
    doc["attention"] = measure_attention([512, 2048, 8192, 32768, 65536])
    table("causal prefill attention", doc["attention"])
    doc["chunk_attention"] = measure_chunk_attention([(4096, 1024), (16384, 2048), (32768, 512), (65536, 4096)])
    table("chunk over history", doc["chunk_attention"])
    doc["decode_attention"] = measure_decode_attention(
        [(1, 4096), (1, 131072), (1, 1048576), (32, 4096), (32, 32768), (128, 4096)]
    )
    table("decode attention (KV read)", doc["decode_attention"])
    doc["copy"] = measure_copy()
    print("\n== copies", doc["copy"])
    prefill, decode = [1024, 4096, 16384, 32768], [(1, 4096), (1, 131072), (16, 4096), (64, 8192), (256, 2048)]
    doc["layer_prefill"], doc["layer_decode"] = measure_layers(SHAPES["llama3-8b"], prefill, decode, args.layers)
    table("decoder layer, prefill", doc["layer_prefill"])
    table("decoder layer, decode step", doc["layer_decode"])
    doc["other_models"] = {}
    for name in args.other_models:  # shapes the efficiencies were not measured on: held-out points
        pre, dec = measure_layers(SHAPES[name], [2048, 16384], [(1, 8192), (32, 4096)], args.layers)
        doc["other_models"][name] = {"layer_prefill": pre, "layer_decode": dec}
        torch.cuda.empty_cache()
        table(f"{name} layer, prefill", pre)
        table(f"{name} layer, decode step", dec)
    doc["wall_s"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {args.out} in {doc['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
