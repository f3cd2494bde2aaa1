"""CSA's compute side (CSPS §3.2.4, "28 % computation time" at zero loss): one attention layer of a larger random
Llama shape (Llama-3-8B's 32 query / 8 KV heads of 128), dense causal attention against CSA over G members'
segments, both through the same kernel (`attention_fwd`: the torch reference on CPU, the Triton kernel on a GPU).

    .venv/bin/python bench/csa_speed.py                       # CPU, 4,096 tokens: bench/results/csa_speed.json
    python bench/csa_speed.py --device cuda --tokens 65536    # a GPU: bench/results/csa_speed_cuda.json

CSA as its members compute it, all on one device: level 1 is each segment's causal attention (one packed call);
each higher level packs, per (level group, KV head), the kept queries of the group's later half against the kept
keys of its earlier half (every level, G a power of two: all keys precede all queries, no mask), one call per
level; the levels merge by
their log-sum-exps. The kept tokens are random per head (importance ranking is not timed). At p = 0 the result
equals dense attention (checked, max |diff| printed). Reported: the seconds of each, their ratio, and the share of
attention pairs CSA computes (`spindle_costmodel.csa.pair_fraction`); the all-to-all bytes are measured by
`spindle verify --csa-drop`, not here.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spindle_attention import reference
from spindle_attention.csa import CSALevels, max_levels
from spindle_attention.merge import merge_attn_states_many
from spindle_costmodel.csa import pair_fraction

RESULTS = Path(__file__).parent / "results"


def kernel(device: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The device's `attention_fwd`."""
    if device.startswith("cuda"):
        from spindle_attention.triton import attention_fwd

        return attention_fwd
    return reference.attention_fwd


def csa_layer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, levels: CSALevels, fwd: Callable, gen: torch.Generator
) -> torch.Tensor:
    """out `[T, Hq, D]` of CSA with random kept tokens per KV head (levels' kept counts)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dev = q.device
    seg = torch.tensor([0] + [e for _, e in levels.segments], device=dev, dtype=torch.int32)
    out1, lse1 = fwd(q, k, v, cu_seqlens_q=seg, cu_seqlens_k=seg, causal=True)
    outs, lses = [out1.float()], [lse1]
    # each member's tokens in a random order per KV head: a level keeps a prefix (nested, as CSA keeps them)
    order = [
        [s + torch.randperm(e - s, generator=gen).to(dev) for s, e in levels.segments] for _ in range(hkv)
    ]  # [Hkv][member] -> positions
    members = len(levels.segments)
    for level in range(2, levels.num_levels + 1):
        qs, ks, cq, ck, where = [], [], [0], [0], []
        for first in sorted({levels.group(level, m)[0] for m in range(members)}):
            a, b = levels.group(level, first)
            lower = {m: levels.group(level - 1, m)[0] for m in range(a, b)}
            for kh in range(hkv):
                qm = [m for m in range(a, b) if lower[m] > a]
                km = [m for m in range(a, b) if lower[m] + 2 ** (level - 2) < b]
                qi = torch.cat([order[kh][m][: levels.kept_count(level, m)] for m in qm])
                ki = torch.cat([order[kh][m][: levels.kept_count(level, m)] for m in km])
                if qi.numel() == 0 or ki.numel() == 0:
                    continue
                qs.append(q[qi, kh * g : (kh + 1) * g])  # [nq, g, D]
                ks.append((k[ki, kh : kh + 1], v[ki, kh : kh + 1]))
                cq.append(cq[-1] + qi.numel())
                ck.append(ck[-1] + ki.numel())
                where.append((qi, kh))
        if not qs:
            continue
        o, lse = fwd(
            torch.cat(qs), torch.cat([x for x, _ in ks]), torch.cat([y for _, y in ks]),
            cu_seqlens_q=torch.tensor(cq, device=dev, dtype=torch.int32),
            cu_seqlens_k=torch.tensor(ck, device=dev, dtype=torch.int32), causal=False,
        )  # fmt: skip
        full = torch.zeros(t, hq, d, device=dev)
        full_lse = torch.full((hq, t), float("-inf"), device=dev)
        for i, (qi, kh) in enumerate(where):
            full[qi, kh * g : (kh + 1) * g] = o[cq[i] : cq[i + 1]].float()
            full_lse[kh * g : (kh + 1) * g, qi] = lse[:, cq[i] : cq[i + 1]]
        outs.append(full)
        lses.append(full_lse)
    out, _ = merge_attn_states_many(torch.stack(outs), torch.stack(lses))
    return out.to(q.dtype)


def timed(fn: Callable[[], object], repeats: int, device: str) -> float:
    fn()  # warm-up (and the Triton compile)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = args.tokens, args.q_heads, args.kv_heads, args.head_dim
    q, k, v = (torch.randn(t, h, d, generator=gen).to(args.device, dtype) for h in (hq, hkv, hkv))
    fwd = kernel(args.device)
    dense_s = timed(lambda: fwd(q, k, v, causal=True), args.repeats, args.device)
    want, _ = fwd(q, k, v, causal=True)
    rows = []
    for members in args.members:
        if members & (members - 1):
            raise ValueError(f"the packing here needs a power-of-two member count, got {members}")
        levels_n = max_levels(members)
        for p in tqdm(sorted(set(args.drops) | {0.0}), desc=f"G={members}"):
            levels = CSALevels.even(t, members, levels_n, p)
            seconds = timed(lambda lv=levels: csa_layer(q, k, v, lv, fwd, gen), args.repeats, args.device)
            base = seconds if p == 0.0 else next(r["csa_s"] for r in rows if r["members"] == members and not r["drop"])
            row = {"members": members, "levels": levels_n, "drop": p, "csa_s": seconds, "dense_s": dense_s,
                   "time_vs_p0": seconds / base, "time_vs_dense": seconds / dense_s,
                   "pairs_kept": pair_fraction(members, levels_n, p)}  # fmt: skip
            if p == 0.0:
                row["max_abs_diff_vs_dense"] = float((csa_layer(q, k, v, levels, fwd, gen) - want).abs().max())
            rows.append(row)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    return {"device": device, "tokens": t, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": args.dtype,
            "kernel": fwd.__module__, "rows": rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--members", type=int, nargs="+", default=[4, 8], help="SP members G (segments)")
    ap.add_argument("--drops", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    doc = run(args)
    print(f"{doc['device']}, {doc['tokens']} tokens, {doc['q_heads']}/{doc['kv_heads']} heads of {doc['head_dim']}, "
          f"{doc['dtype']}, kernel {doc['kernel']}; dense {doc['rows'][0]['dense_s'] * 1e3:.1f} ms")  # fmt: skip
    print("| G | levels | drop p | CSA ms | vs CSA at p = 0 | vs dense | pairs kept |")
    print("|---|---|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['members']} | {r['levels']} | {r['drop']} | {r['csa_s'] * 1e3:.1f} | {r['time_vs_p0']:.2f} | "
              f"{r['time_vs_dense']:.2f} | "
              f"{r['pairs_kept']:.2f} |" + (f" (p=0 vs dense: {r['max_abs_diff_vs_dense']:.1e})" if r["drop"] == 0
                                            else ""))  # fmt: skip
    out = args.out or RESULTS / ("csa_speed_cuda.json" if args.device.startswith("cuda") else "csa_speed.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
