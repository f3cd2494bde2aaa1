"""What one Seesaw switch costs (issue 25, §4.1): every rank of a re-sharding group rebuilds its shard of the next
parallel configuration from the weights in shared host memory (`HostWeights`, published once), against the peer, a
restart into the new configuration that re-reads the checkpoint from disk (safetensors, its pages dropped from the
page cache first with `posix_fadvise(DONTNEED)`). Also the host KV tier's
write and read rate (a prompt's KV from the device cache to the tier and back), which sets how much of the swaps a
phase can hide.

One process per rank of the plan, on one device (`--device cuda`: all ranks on GPU 0, so each rank's copy
contends with the others' for one PCIe link, as N GPUs of a node share the host's memory bandwidth). Prints a
table, writes JSON.

    .venv/bin/python bench/reshard_switch.py                                     # SmolLM2 on this CPU, PP2:TP2
    python bench/reshard_switch.py --device cuda --random 1b --dtype bfloat16    # a 1.2 B Llama on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(p) for p in Path(__file__).resolve().parents[1].glob("libs/*")]  # the GPU machine runs from a copy

from spindle_engine.config import EngineConfig  # noqa: E402
from spindle_engine.kv_cache import KVCache  # noqa: E402
from spindle_engine.reshard import HostWeights, ReshardPlan  # noqa: E402
from spindle_engine.reshard.group import build_shard, label  # noqa: E402
from spindle_engine.reshard.tier import TierPut, open_kv, push_cache, read_share  # noqa: E402
from spindle_model import load_state_dict, resolve_model  # noqa: E402
from spindle_model.testing import run_gloo  # noqa: E402

RANDOM = {  # hidden, layers, heads, kv heads, intermediate, vocab: a smoke test; Llama-3.2-1B's shape; Llama-3-8B's
    "tiny": (256, 4, 8, 2, 512, 1000),
    "1b": (2048, 16, 32, 8, 8192, 128256),
    "8b": (4096, 32, 32, 8, 14336, 128256),
}


def random_checkpoint(path: Path, shape: str, dtype: torch.dtype) -> Path:
    """A Llama checkpoint of random weights in the Hugging Face layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    h, layers, heads, kv, inter, vocab = RANDOM[shape]
    d = h // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    w = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(dtype)  # noqa: E731
    state = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h, dtype=dtype),
             "lm_head.weight": w(vocab, h)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                  p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                  p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                  p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}  # fmt: skip
    save_file(state, str(path / "model.safetensors"))
    return path


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def worker(rank: int, world: int, model: str, plan_text: str, weights: str, device: str, dtype: str, rounds: int,
           kv_tokens: int) -> dict[str, torch.Tensor]:  # fmt: skip
    plan = ReshardPlan.parse(plan_text)
    source = resolve_model(model)
    config = EngineConfig(model=model, dtype=dtype, device=device)
    host = HostWeights(Path(weights))
    out: dict[str, list[float]] = {}

    def timed(key: str, build: Callable[[], tuple], cold: bool = False) -> None:
        if cold:  # the checkpoint's pages out of the page cache: a re-read comes from the disk
            for f in Path(source.path).glob("*.safetensors"):
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        shard, _ = build()
        _sync(device)
        out.setdefault(key, []).append(time.perf_counter() - t0)
        out.setdefault(key + ":bytes", [float(sum(p.numel() * p.element_size() for p in shard.parameters()))])
        del shard
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    for _ in range(rounds):
        for par in (plan.prefill, plan.decode):
            timed(f"host:{label(par)}", lambda par=par: build_shard(source.config, config, par, 0, rank, host))
            timed(f"disk:{label(par)}", lambda par=par: build_shard(
                source.config, config, par, 0, rank, load_state_dict(source.path, dtype=config.torch_dtype)),
                cold=True)  # fmt: skip
    # the host KV tier: this rank's share of a prompt's KV (a pipeline stage's layers, every head), cache -> tier
    mc = source.config
    par = plan.prefill
    stage = par.position(rank)[0]
    layers = par.layers(stage, mc.num_layers)
    cache = KVCache(layers[1] - layers[0], -(-kv_tokens // 16), 16, mc.num_kv_heads, mc.head_dim, config.torch_dtype,
                    torch.device(device))  # fmt: skip
    cache.k.normal_()
    cache.v.normal_()
    put = TierPut(f"bench{rank}.kv", list(range(-(-kv_tokens // 16))), kv_tokens, kv_tokens)
    tier = Path(weights).parent
    store = open_kv(tier, put.name, mc, kv_tokens, config.torch_dtype, create=True)
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        nbytes = push_cache(store, cache, put, layers[0], (0, mc.num_kv_heads))
        out.setdefault("tier_write", []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # a decode rank of TP `world` reads its heads of every layer
        heads = (rank * mc.num_kv_heads // world, (rank + 1) * mc.num_kv_heads // world)
        kv = read_share(store, heads, kv_tokens).to(device)
        _sync(device)
        out.setdefault("tier_read", []).append(time.perf_counter() - t0)
    out["tier_write:bytes"] = [float(nbytes)]
    out["tier_read:bytes"] = [float(kv.numel() * kv.element_size())]
    (tier / put.name).unlink()
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a model name or directory (default %(default)s)")
    p.add_argument("--random", choices=sorted(RANDOM), help="instead: a random Llama of this shape, written first")
    p.add_argument("--plan", default="PP2:TP2", help="PREFILL:DECODE (default %(default)s)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-tokens", type=int, default=8192, help="tokens of KV each rank writes and reads (%(default)s)")
    p.add_argument("--json", type=Path, default=Path("bench/results/reshard_switch.json"))
    args = p.parse_args(argv)
    plan = ReshardPlan.parse(args.plan)
    model = args.model
    if args.random:
        model = str(random_checkpoint(Path(tempfile.mkdtemp()) / f"random-{args.random}", args.random,
                                      getattr(torch, args.dtype)))  # fmt: skip
    source = resolve_model(model)
    need = 2 * sum(f.stat().st_size for f in Path(source.path).glob("*.safetensors"))
    shm = "/dev/shm" if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > need else None
    with tempfile.TemporaryDirectory(dir=shm) as shm:
        t0 = time.perf_counter()
        host = HostWeights.publish(load_state_dict(source.path, dtype=getattr(torch, args.dtype)), Path(shm) / "w")
        publish_s = time.perf_counter() - t0
        out = run_gloo(worker, plan.world, Path(shm), model, args.plan, str(host.path), args.device, args.dtype,
                       args.rounds, args.kv_tokens, timeout=1200)  # fmt: skip
    rows = []
    for key in sorted(k for k in out[0] if not k.endswith(":bytes")):
        secs = [statistics.median(r[key].tolist()) for r in out]
        nbytes = [r[key + ":bytes"].item() for r in out]
        rows.append({"what": key, "seconds_per_rank": secs, "bytes_per_rank": nbytes, "seconds": max(secs),
                     "bytes": sum(nbytes), "gb_per_s": sum(nbytes) / max(secs) / 1e9})  # fmt: skip
    print(f"{source.name} ({args.dtype}) on {args.device}, {args.plan}; weights published once to host memory: "
          f"{host.nbytes / 2**20:.0f} MiB in {publish_s:.2f} s; medians of {args.rounds} rounds")  # fmt: skip
    print(f"{'rebuild':<14} {'slowest rank s':>14} {'MiB (all)':>10} {'GB/s':>7}")
    for r in rows:
        print(f"{r['what']:<14} {r['seconds']:>14.3f} {r['bytes'] / 2**20:>10.1f} {r['gb_per_s']:>7.2f}")
    for par in (plan.prefill, plan.decode):
        h, d = (next(r for r in rows if r["what"] == f"{k}:{label(par)}") for k in ("host", "disk"))
        print(f"switch to {label(par)}: {h['seconds']:.3f} s from host memory, {d['seconds']:.3f} s re-reading the "
              f"checkpoint ({d['seconds'] / h['seconds']:.1f}x)")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    doc = {"model": source.name, "dtype": args.dtype, "device": args.device, "plan": args.plan,
           "host_weight_bytes": host.nbytes, "publish_s": publish_s, "rounds": args.rounds,
           "kv_tokens": args.kv_tokens, "rows": rows}  # fmt: skip
    if args.device.startswith("cuda"):
        doc["gpu"] = torch.cuda.get_device_name(0)
    args.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
